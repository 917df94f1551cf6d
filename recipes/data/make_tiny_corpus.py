"""Regenerate tiny_corpus.txt: deterministic English-like sentences about training jobs (a learnable toy corpus).

Run: python recipes/data/make_tiny_corpus.py   (the output is committed; this documents where it came from)
"""

import random
from pathlib import Path

SUBJECTS = ["the engineer", "the cluster", "a training job", "the scheduler", "the optimizer", "every rank",
            "the pipeline", "the data loader", "the checkpoint", "the model", "a small team", "the network"]
VERBS = ["saves", "restores", "splits", "checks", "measures", "loads", "sends", "waits for", "reduces", "gathers",
         "writes", "reads", "plans", "launches"]
OBJECTS = ["the gradients", "a checkpoint", "the weights", "the optimizer states", "every shard", "the activations",
           "the next batch", "the learning rate", "a log line", "the loss", "the parameters", "the tokens"]
ENDINGS = ["before the step ends", "after every hundred steps", "on each node", "without losing a byte",
           "while the GPUs compute", "when a rank fails", "in a few seconds", "at the end of the epoch",
           "so the run can resume", "and the loss falls"]


def sentence(rng: random.Random) -> str:
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
    return text[0].upper() + text[1:] + "."


def main() -> None:
    rng = random.Random(1234)
    paragraphs = [" ".join(sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(600)]
    Path(__file__).with_name("tiny_corpus.txt").write_text("\n".join(paragraphs) + "\n")


if __name__ == "__main__":
    main()
