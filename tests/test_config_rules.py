"""Config rules that used to pass silently: each now raises naming the field and the rule."""

from __future__ import annotations

import pytest

from model import ModelConfig


def test_engram_layer_after_the_replay_cut():
    """An Engram layer after the last KV source would meet narrowed rows under decoder-side bounded replay
    (the step failed with a shape error); the config says why it is not allowed."""
    with pytest.raises(ValueError, match=r"Engram layers \[6\] lie after the last KV source \(layer 5\).*"
                                         r"must be at or before the last KV source"):
        ModelConfig.preset("tiny-v41").replace(engram_layer_ids=(1, 6))
    ModelConfig.preset("tiny-v41").replace(engram_layer_ids=(1, 5))  # at the last source: every row


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engram_placement_is_validated_for_every_generation(preset):
    with pytest.raises(ValueError, match=r"engram_placement must be one of \('device', 'sharded', 'host'\), got 'gpu'"):
        ModelConfig.preset(preset).replace(engram_placement="gpu")


@pytest.mark.parametrize("field,value,why", [
    ("tie_word_embeddings", True, "a separate LM head"),
    ("attention_bias", True, "no bias in any attention projection"),
    ("mlp_bias", True, "no bias in any expert projection"),
    ("hidden_act", "gelu", "clamped SwiGLU experts"),
    ("topk_method", "greedy", "the router's bias chooses experts only"),
])
def test_config_json_fields_the_architecture_fixes(field, value, why):
    raw = ModelConfig.preset("tiny-v4").to_official_dict()
    assert ModelConfig.from_hf({**raw, field: None}).hidden_size == 128  # absent / null: the default
    with pytest.raises(ValueError, match=rf"{field}={value!r} is not supported .*{why}"):
        ModelConfig.from_hf({**raw, field: value})
