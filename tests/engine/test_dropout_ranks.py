"""How data-parallel ranks draw dropout masks (engine.step.dropout): each rank's mask is
its rows of the mask one process draws for the whole batch, from the same seed."""

from __future__ import annotations

import torch
from torch.nn import functional

from engine.step.dropout import WholeBatchDropout


def test_the_ranks_masks_put_together_are_one_process_masks() -> None:
    x = torch.randn(6, 5, 8)
    torch.manual_seed(3)
    one = functional.dropout(x, 0.1, training=True)
    after_one = torch.random.get_rng_state()
    for world in (1, 2, 3):
        rows = 6 // world
        parts = []
        for rank in range(world):
            torch.manual_seed(3)  # every rank seeds alike
            with WholeBatchDropout(rank, world):
                parts.append(functional.dropout(x[rank * rows:(rank + 1) * rows], 0.1,
                                                training=True))
            assert torch.equal(torch.random.get_rng_state(), after_one)  # in step after
        assert torch.equal(torch.cat(parts), one), f"{world} ranks"


def test_outside_training_it_is_torchs_dropout() -> None:
    x = torch.randn(4, 3)
    with WholeBatchDropout(1, 2):
        assert torch.equal(functional.dropout(x, 0.5, training=False), x)
        assert torch.equal(functional.dropout(x, 0.0, training=True), x)


def test_only_a_model_that_drops_out_has_its_masks_drawn_so() -> None:
    from transformers import OPTConfig, OPTForCausalLM

    from engine.models.training import drops_out

    def opt(p: float) -> torch.nn.Module:
        return OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, ffn_dim=32,
                                        word_embed_proj_dim=16, dropout=p))

    assert drops_out(opt(0.1)) and not drops_out(opt(0.0))
    assert drops_out(torch.nn.TransformerEncoderLayer(8, 2, dropout=0.1))
    assert not drops_out(torch.nn.TransformerEncoderLayer(8, 2, dropout=0.0))
