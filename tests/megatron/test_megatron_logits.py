"""TP=2 and TP=1 give the same logits for the same weights: the DP=2 run's dist checkpoint (its resumed run's
synchronous save, which any layout loads) loaded at both layouts by real Megatron-Core on 2 gloo ranks (fp32; only the
order of the row-parallel sums differs)."""

from pathlib import Path

import pytest
from megatron_helpers import STEPS

pytestmark = pytest.mark.launch
SCRIPT = Path(__file__).resolve().parent / "mcore_logits.py"


@pytest.fixture(scope="module")
def logits(dp2_resumed, torchrun, distopt_sync_recipe):
    import torch

    checkpoint = dp2_resumed.out / f"checkpoint-{STEPS}"
    run = torchrun("logits", "--recipe", str(distopt_sync_recipe), "--checkpoint", str(checkpoint), script=SCRIPT)
    path = run.out / "logits.pt"
    assert path.is_file(), run.tail()
    return torch.load(path)


def test_tp2_logits_equal_tp1_logits_for_the_same_weights(logits):
    import torch

    tp1, tp2 = logits["tp1"], logits["tp2"]
    assert tp1.shape == tp2.shape == (2, 64, 512)
    assert tp1.std() > 0.1  # real logits, not a degenerate output
    torch.testing.assert_close(tp2, tp1, rtol=1e-5, atol=1e-5)


def test_the_checkpoint_weights_were_loaded(logits):
    """A fresh model's logits differ: the equality above is about the trained weights, not the same random init."""
    assert (logits["tp1"] - logits["fresh"]).abs().max() > 0.1
