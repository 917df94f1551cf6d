"""Regenerate tiny_chat.jsonl and tiny_prompt_completion.jsonl: deterministic question/answer pairs about training jobs
(small sums and facts a tiny model learns in a few steps), for the fine-tuning tests and the demo.

Run: python recipes/data/make_tiny_sft.py   (the outputs are committed; this documents where they came from)
"""

import json
import random
from pathlib import Path

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
FACTS = {
    "What saves the weights?": "The checkpoint saves the weights.",
    "What splits the batch?": "The data loader splits the batch.",
    "What reduces the gradients?": "Every rank reduces the gradients.",
    "What plans the run?": "The planner plans the run.",
    "What launches the job?": "The scheduler launches the job.",
    "What measures the loss?": "The trainer measures the loss.",
}
SYSTEM = "You answer questions about training jobs in one short sentence."


def question(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.6:
        a, b = rng.randint(0, 6), rng.randint(0, 6)
        return f"How many GPUs are {NUMBERS[a]} GPUs and {NUMBERS[b]} GPUs?", f"That makes {NUMBERS[a + b]} GPUs."
    return rng.choice(sorted(FACTS.items()))


def chat(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 2)):
        prompt, answer = question(rng)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main() -> None:
    rng = random.Random(2026)
    here = Path(__file__).parent
    chats = [chat(rng) for _ in range(400)]
    (here / "tiny_chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    pairs = [question(rng) for _ in range(400)]
    (here / "tiny_prompt_completion.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"}) + "\n" for q, a in pairs))


if __name__ == "__main__":
    main()
