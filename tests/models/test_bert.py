"""BertModel and the pooler: parity with transformers on all-MiniLM-L6-v2 (mean pooling and
L2 normalization written out here, as sentence-transformers does them) and on a tiny
random BERT with CLS pooling; weight names as checkpoints spell them; the dummy load; the
pooler's settings from a sentence-transformers folder and from --pooler-config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoTokenizer, BertConfig, BertModel, LlamaConfig

from aioserve.models.bert import BertModel as OurBertModel
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loader import load_model
from aioserve.models.pooler import (
    PoolerConfig,
    pool,
    pooler_config_for,
)
from aioserve.models.registry import is_pooling_architecture
from tests.models.tiny_models import hf_bert_and_ours, tiny_bert_config, tiny_roberta_config

SENTENCES = [
    "A man is eating food.",
    "Hi",
    "A man is riding a white horse on an enclosed ground, while the children watch from "
    "the fence and a dog runs after a ball that one of them threw across the field.",
    "The quick brown fox jumps over the lazy dog.",
]


def packed(token_lists: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """input_ids, positions, cu_seqlens of prompts packed one after another, max_seqlen."""
    lengths = [len(tokens) for tokens in token_lists]
    input_ids = torch.tensor([t for tokens in token_lists for t in tokens])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, positions, cu_seqlens, max(lengths)


def hf_mean_pooled(hf: BertModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' last hidden states [B, L, H] and sentence-transformers' embeddings:
    the mean over the attention mask, L2-normalized."""
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return hidden, F.normalize(mean, p=2, dim=-1)


@pytest.fixture(scope="module")
def minilm(minilm_folder):
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    hf = BertModel.from_pretrained(minilm_folder, dtype=torch.float32, attn_implementation="eager")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    hf_hidden, hf_embeddings = hf_mean_pooled(hf.eval(), batch)
    tokens = [tokenizer(s).input_ids for s in SENTENCES]
    return Path(minilm_folder), tokens, hf_hidden, hf_embeddings


def _ours(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    checkpoint = open_checkpoint(str(folder))
    return load_model(checkpoint, dtype=dtype, device=torch.device("cpu"), use_tqdm=False)


def test_minilm_float32_matches_transformers(minilm):
    folder, tokens, hf_hidden, hf_embeddings = minilm
    model = _ours(folder, torch.float32)
    input_ids, positions, cu_seqlens, max_seqlen = packed(tokens)
    with torch.inference_mode():
        hidden = model(input_ids, positions, cu_seqlens, max_seqlen)
    assert hidden.shape == (len(input_ids), 384) and hidden.dtype == torch.float32
    for b, (start, end) in enumerate(
        zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)
    ):
        torch.testing.assert_close(
            hidden[start:end], hf_hidden[b, : end - start], atol=1e-5, rtol=1e-5
        )

    config = pooler_config_for(folder, model.config, {})
    assert config == PoolerConfig(pooling_type="MEAN", normalize=True)
    pooled = pool(hidden, cu_seqlens, config.pooling_type)
    embeddings = F.normalize(pooled, dim=-1)
    torch.testing.assert_close(embeddings, hf_embeddings, atol=1e-5, rtol=1e-5)


def test_minilm_bfloat16_keeps_the_embeddings_direction(minilm):
    folder, tokens, _, hf_embeddings = minilm
    model = _ours(folder, torch.bfloat16)
    input_ids, positions, cu_seqlens, max_seqlen = packed(tokens)
    with torch.inference_mode():
        hidden = model(input_ids, positions, cu_seqlens, max_seqlen)
    assert hidden.dtype == torch.bfloat16
    embeddings = F.normalize(pool(hidden, cu_seqlens, "MEAN"), dim=-1)
    cosines = (embeddings * hf_embeddings).sum(-1)
    assert cosines.min() > 0.999, cosines


def test_minilm_checkpoint_tensors_all_land(minilm_folder):
    """Its 104 tensors: 100 fill the parameters (q/k/v stacked three to one); BERT's pooler
    and the position-id buffer are skipped."""
    with safe_open(Path(minilm_folder) / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    config = BertConfig.from_pretrained(minilm_folder)
    with torch.device("meta"):
        ours = OurBertModel(config)
    targets = {name: ours.parameter_for(name) for name in names}
    skipped = {name for name, target in targets.items() if target is None}
    assert skipped == {"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"}
    filled = {target[0] for target in targets.values() if target is not None}
    assert filled == set(dict(ours.named_parameters()))


def tiny_bert_ours() -> torch.nn.Module:
    return hf_bert_and_ours(tiny_bert_config())[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_bert_cls_pooling_matches_transformers(dtype):
    hf, ours = hf_bert_and_ours(tiny_bert_config(), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 40, 17]
    token_lists = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
    input_ids, positions, cu_seqlens, max_seqlen = packed(token_lists)
    with torch.inference_mode():
        hidden = ours(input_ids, positions, cu_seqlens, max_seqlen)
        embeddings = F.normalize(pool(hidden, cu_seqlens, "CLS"), dim=-1)
        expected = []
        for tokens in token_lists:
            out = hf(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            expected.append(F.normalize(out[0], dim=-1))
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=0)
    torch.testing.assert_close(embeddings, torch.stack(expected), **tolerance)


@pytest.mark.parametrize("architecture", ["RobertaModel", "XLMRobertaModel"])
def test_tiny_roberta_matches_transformers(architecture):
    """Positions from pad_token_id + 1, "roberta." names, and the longest prompt the
    position table holds."""
    config = tiny_roberta_config(architecture)
    hf, ours = hf_bert_and_ours(config)
    assert type(ours).__name__ == architecture
    assert type(ours).max_prompt_len(config) == 128
    token_lists = [[0, 5, 6, 7, 2], list(range(3, 131))]
    input_ids, positions, cu_seqlens, max_seqlen = packed(token_lists)
    with torch.inference_mode():
        hidden = ours(input_ids, positions, cu_seqlens, max_seqlen)
        for tokens, (start, end) in zip(token_lists, [(0, 5), (5, 133)], strict=True):
            expected = hf(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start:end], expected, atol=1e-5, rtol=1e-5)
    prefixed = {f"roberta.{name}": t for name, t in hf.state_dict().items()}
    _, fresh = hf_bert_and_ours(config, seed=1)
    fresh.load_weights(prefixed.items())
    for name, param in ours.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], param)


def test_tiny_bert_through_the_triton_kernel(triton_backend):
    """The whole model with its attention in the Triton kernel (interpreted on the CPU)."""
    hf, ours = hf_bert_and_ours(tiny_bert_config())
    token_lists = [[5, 6, 7], list(range(1, 20))]
    input_ids, positions, cu_seqlens, max_seqlen = packed(token_lists)
    with torch.inference_mode():
        hidden = ours(input_ids, positions, cu_seqlens, max_seqlen)
        for tokens, (start, end) in zip(token_lists, [(0, 3), (3, 22)], strict=True):
            expected = hf(input_ids=torch.tensor([tokens])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start:end], expected, atol=1e-5, rtol=1e-5)


def test_token_type_ids_are_read_when_given():
    hf, ours = hf_bert_and_ours(tiny_bert_config())
    tokens, types = [3, 9, 27, 81, 4], [0, 0, 0, 1, 1]
    input_ids, positions, cu_seqlens, max_seqlen = packed([tokens])
    with torch.inference_mode():
        hidden = ours(input_ids, positions, cu_seqlens, max_seqlen, torch.tensor(types))
        expected = hf(
            input_ids=torch.tensor([tokens]), token_type_ids=torch.tensor([types])
        ).last_hidden_state[0]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_weights_load_with_a_bert_prefix_and_legacy_layer_norm_names():
    hf, ours = hf_bert_and_ours(tiny_bert_config())
    renamed = {
        "bert."
        + name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): tensor
        for name, tensor in hf.state_dict().items()
    }
    renamed["cls.predictions.bias"] = torch.zeros(256)  # a pre-training head: skipped
    _, fresh = hf_bert_and_ours(tiny_bert_config(), seed=1)
    assert fresh.load_weights(renamed.items()) == set(dict(fresh.named_parameters()))
    for name, param in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], param), name


def test_an_unknown_tensor_is_refused():
    ours = tiny_bert_ours()
    with pytest.raises(ValueError, match="no parameter"):
        ours.load_weights([("encoder.layer.0.attention.self.rotary.weight", torch.zeros(1))])


def test_dummy_load_builds_a_working_model(tmp_path):
    tiny_bert_config().save_pretrained(tmp_path)
    checkpoint = open_checkpoint(str(tmp_path), load_format="dummy")
    model = load_model(
        checkpoint, dtype=torch.float32, device=torch.device("cpu"), dummy=True, use_tqdm=False
    )
    input_ids, positions, cu_seqlens, max_seqlen = packed([[1, 2, 3], [4]])
    with torch.inference_mode():
        hidden = model(input_ids, positions, cu_seqlens, max_seqlen)
    assert hidden.shape == (4, 64) and torch.isfinite(hidden).all()


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="relative_key"):
        hf_bert_and_ours(BertConfig(**{**_tiny(), "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="swish"):
        hf_bert_and_ours(BertConfig(**{**_tiny(), "hidden_act": "swish"}))


def _tiny() -> dict:
    return tiny_bert_config().to_dict()


def test_pooling_architectures():
    assert is_pooling_architecture(tiny_bert_config())
    assert not is_pooling_architecture(LlamaConfig(architectures=["LlamaForCausalLM"]))


# -- the pooler ---------------------------------------------------------------------------


def test_pool_mean_cls_last_in_float32():
    # Six rows of three prompts, then two padding rows, which no pooling may read.
    hidden = torch.cat([torch.arange(12.0).reshape(6, 2), torch.full((2, 2), 1e4)])
    hidden = hidden.to(torch.bfloat16)
    cu_seqlens = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    mean = pool(hidden, cu_seqlens, "MEAN")
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean, torch.tensor([[0.0, 1.0], [4.0, 5.0], [9.0, 10.0]]))
    torch.testing.assert_close(pool(hidden, cu_seqlens, "CLS"), hidden[[0, 1, 4]].float())
    torch.testing.assert_close(pool(hidden, cu_seqlens, "LAST"), hidden[[0, 3, 5]].float())
    with pytest.raises(ValueError, match="MAX"):
        pool(hidden, cu_seqlens, "MAX")


def _st_folder(tmp_path: Path, pooling: dict, normalize: bool = True, extra=()) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    modules += list(extra)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_pooler_config_from_minilms_folder_and_overrides(minilm_folder):
    folder, config = Path(minilm_folder), tiny_bert_config()
    assert pooler_config_for(folder, config, {}) == PoolerConfig("MEAN", True)
    assert pooler_config_for(folder, config, {"pooling_type": "CLS"}) == PoolerConfig("CLS", True)
    assert pooler_config_for(folder, config, {"seq_pooling_type": "LAST"}).pooling_type == "LAST"
    assert pooler_config_for(folder, config, {"use_activation": False}) == PoolerConfig(
        "MEAN", False
    )
    defaults = {"task": "embed", "enable_chunked_processing": False, "logit_mean": None}
    assert pooler_config_for(folder, config, defaults) == PoolerConfig("MEAN", True)


def test_pooler_config_without_sentence_transformers_files_is_vllms_default(tmp_path):
    assert pooler_config_for(tmp_path, tiny_bert_config(), {}) == PoolerConfig("CLS", True)
    assert pooler_config_for(None, tiny_bert_config(), None) == PoolerConfig("CLS", True)


@pytest.mark.parametrize(
    "pooling, expected",
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
        ({"pooling_mode_lasttoken": True, "include_prompt": True}, "LAST"),
        ({"pooling_mode": "mean", "word_embedding_dimension": 64}, "MEAN"),
    ],
)
def test_sentence_transformers_pooling_modes(tmp_path, pooling, expected):
    folder = _st_folder(tmp_path, pooling, normalize=False)
    assert pooler_config_for(folder, tiny_bert_config(), {}) == PoolerConfig(expected, False)


@pytest.mark.parametrize(
    "pooling, message",
    [
        ({"pooling_mode_max_tokens": True}, "max_tokens pooling"),
        ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens pooling"),
        ({"pooling_mode": "weightedmean"}, "weightedmean pooling"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "several poolings"),
    ],
)
def test_sentence_transformers_poolings_not_supported_are_refused(tmp_path, pooling, message):
    folder = _st_folder(tmp_path, pooling)
    with pytest.raises(ValueError, match=message):
        pooler_config_for(folder, tiny_bert_config(), {})


def test_a_dense_module_after_the_pooling_is_refused(tmp_path):
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    folder = _st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, extra=[dense])
    with pytest.raises(ValueError, match="Dense"):
        pooler_config_for(folder, tiny_bert_config(), {})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"normalize": True}, "use `use_activation` instead"),
        ({"pooling_type": "MAX"}, "not a pooling type"),
        ({"pooling_type": "ALL"}, "token-level"),
        ({"pooling_type": "CLS", "seq_pooling_type": "MEAN"}, "cannot set both"),
        ({"softmax": True}, "unknown keys softmax"),
        ({"task": "classify"}, "this model's task is 'embed'"),
        ({"enable_chunked_processing": True}, "chunked processing"),
        ({"step_tag_id": 3}, "reward models"),
        ({"use_activation": "yes"}, "true or false"),
        ({"dimensions": 32}, "does not support Matryoshka"),
    ],
)
def test_pooler_overrides_not_honoured_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        pooler_config_for(None, tiny_bert_config(), overrides)


def test_dimensions_of_a_matryoshka_model():
    config = BertConfig(**{**_tiny(), "matryoshka_dimensions": [16, 32, 64]})
    assert pooler_config_for(None, config, {"dimensions": 32}).dimensions == 32
    with pytest.raises(ValueError, match="supports"):
        pooler_config_for(None, config, {"dimensions": 48})
