"""What a checkpoint's sentence-transformers files make of its pooler, and the head's scores."""

from __future__ import annotations

import json

import pytest
import torch
from pooling.checkpoints import ST, save_embedding_checkpoint

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.models import load_model_config
from pagedllm.pooling import read_pooler_config
from pagedllm.pooling.pooler import class_scores


def test_a_causal_lm_without_modules_is_pooled_by_its_last_token_normalized(tmp_path):
    config = read_pooler_config(load_model_config(save_embedding_checkpoint(tmp_path)), "embed")
    assert (config.pooling_type, config.normalize, config.matryoshka) == ("LAST", True, False)


def test_the_pooling_module_and_a_missing_normalize_module_are_read(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="cls", normalize=False, matryoshka=True)
    config = read_pooler_config(load_model_config(folder), "embed")
    assert (config.pooling_type, config.normalize, config.matryoshka) == ("CLS", False, True)


def test_an_unsupported_module_is_refused_by_name(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": ST + "Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=r"module \[3\] type .*Dense.* is not supported"):
        read_pooler_config(load_model_config(folder), "embed")


def test_a_max_pooling_mode_is_refused_naming_the_field(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="mean")
    path = folder / "1_Pooling" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pooling_mode_max_tokens": True}))
    with pytest.raises(CheckpointError, match="pooling_mode_max_tokens is not supported"):
        read_pooler_config(load_model_config(folder), "embed")


def test_a_single_logit_scores_by_sigmoid_and_several_by_softmax():
    single = torch.tensor([[0.0], [2.0]])
    assert torch.allclose(class_scores(single), torch.sigmoid(single))
    several = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(class_scores(several), torch.softmax(several, dim=-1))
    assert class_scores(several).sum().item() == pytest.approx(1.0)
