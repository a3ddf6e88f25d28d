"""The often-served model presets against their Hugging Face config.json, and the ids a real run records
for them (a Hugging Face id, an older or base variant, a local folder)."""

import json

import pytest

from servelab.common.errors import ServelabError
from servelab.runners.presets import MODEL_SOURCES, MODELS, find_model, model_from_hf_config

# The shape fields of each repository's config.json (huggingface.co/<id>/blob/main/config.json), as published
CONFIGS = {
    "llama-3-8b": {"_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False},
    "llama-3.2-3b": {"_name_or_path": "meta-llama/Llama-3.2-3B-Instruct", "hidden_size": 3072, "head_dim": 128,
                     "intermediate_size": 8192, "num_attention_heads": 24, "num_key_value_heads": 8,
                     "num_hidden_layers": 28, "vocab_size": 128256, "max_position_embeddings": 131072,
                     "tie_word_embeddings": True},
    "llama-3.3-70b": {"_name_or_path": "meta-llama/Llama-3.3-70B-Instruct", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
                      "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 131072,
                      "tie_word_embeddings": False},
    "qwen2.5-3b": {"_name_or_path": "Qwen/Qwen2.5-3B-Instruct", "hidden_size": 2048, "intermediate_size": 11008,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 36,
                   "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-14b": {"_name_or_path": "Qwen/Qwen2.5-14B-Instruct", "hidden_size": 5120, "intermediate_size": 13824,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 48,
                    "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "qwen3-0.6b": {"_name_or_path": "Qwen/Qwen3-0.6B", "hidden_size": 1024, "head_dim": 128, "intermediate_size": 3072,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 28, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "qwen3-1.7b": {"_name_or_path": "Qwen/Qwen3-1.7B", "hidden_size": 2048, "head_dim": 128, "intermediate_size": 6144,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 28, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "qwen3-4b": {"_name_or_path": "Qwen/Qwen3-4B", "hidden_size": 2560, "head_dim": 128, "intermediate_size": 9728,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "qwen3-8b": {"_name_or_path": "Qwen/Qwen3-8B", "hidden_size": 4096, "head_dim": 128, "intermediate_size": 12288,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 36, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False},
    "qwen3-14b": {"_name_or_path": "Qwen/Qwen3-14B", "hidden_size": 5120, "head_dim": 128, "intermediate_size": 17408,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 40, "vocab_size": 151936,
                  "max_position_embeddings": 40960, "tie_word_embeddings": False},
    "qwen3-235b-a22b": {"_name_or_path": "Qwen/Qwen3-235B-A22B", "hidden_size": 4096, "head_dim": 128,
                        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "num_hidden_layers": 94, "num_experts": 128,
                        "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                        "tie_word_embeddings": False},
    "mixtral-8x7b": {"_name_or_path": "mistralai/Mixtral-8x7B-Instruct-v0.1", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "gpt-oss-20b": {"_name_or_path": "openai/gpt-oss-20b", "hidden_size": 2880, "head_dim": 64,
                    "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
                    "max_position_embeddings": 131072, "sliding_window": 128, "tie_word_embeddings": False,
                    "layer_types": ["sliding_attention", "full_attention"] * 12,
                    "quantization_config": {"quant_method": "mxfp4"}},
}
FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size",
          "tied_embeddings", "num_experts", "experts_per_token", "shared_ffn_size", "max_position_embeddings",
          "sliding_window", "sliding_layers", "quantization")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_preset_equals_its_config_read(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    read, preset = model_from_hf_config(str(path)), MODELS[name]
    for key in FIELDS:
        assert getattr(read, key) == getattr(preset, key), key
    repository = CONFIGS[name]["_name_or_path"]
    assert MODEL_SOURCES[name].config_url == f"https://huggingface.co/{repository}/blob/main/config.json"
    assert MODEL_SOURCES[name].calibrated is False


@pytest.mark.parametrize(("recorded", "preset"), [
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),  # the older id of Llama-3.1-8B
    ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
    ("/models/Qwen3-235B-A22B", "qwen3-235b-a22b"),  # vLLM serving a local folder named as the repository
    ("/data/Llama-3.3-70B-Instruct/", "llama-3.3-70b"),
    ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
])
def test_a_recorded_id_finds_its_preset(recorded, preset):
    assert find_model(recorded).name == preset


@pytest.mark.parametrize(("recorded", "preset", "fmt"), [
    ("Qwen/Qwen3-8B-FP8", "qwen3-8b", "fp8"),
    ("RedHatAI/Llama-3.1-8B-Instruct-FP8-dynamic", "llama-3.1-8b", "fp8"),
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "llama-3.1-8b", "int4"),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "qwen2.5-7b", "awq"),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "qwen2.5-7b", "int8-weight-only"),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "llama-3.1-70b", "awq"),
    ("nvidia/Llama-3.3-70B-Instruct-FP4", "llama-3.3-70b", "nvfp4"),
])
def test_a_quantised_checkpoint_is_its_base_model_in_its_format(recorded, preset, fmt):
    got, base = find_model(recorded), MODELS[preset]
    assert got.quantization == fmt and got.hf_id == recorded
    assert all(getattr(got, k) == getattr(base, k) for k in FIELDS if k != "quantization")
    assert got.weight_bytes < base.weight_bytes  # fewer bytes per weight than bf16


@pytest.mark.parametrize("recorded", ["Qwen/Qwen3-8B-Q4", "/models/my-finetune", "facebook/opt-125m", "foo/bar-fp8",
                                      "openai/gpt-oss-20b-fp8"])  # (gpt-oss is MXFP4 already: not its shapes)
def test_a_different_model_is_not_taken_for_a_preset(recorded):
    with pytest.raises(ServelabError, match="unknown model preset"):
        find_model(recorded)
