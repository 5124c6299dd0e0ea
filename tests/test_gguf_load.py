"""GGUF in, kept packed (`hf_accel.load_gguf`, `hf_accel.load_model("x.gguf")`): Q8_0 / Q4_0 Linears become
`Int8Linear` / `Int4Linear` in groups of 32 holding the file's codes, and the weights they multiply by are exactly
those of transformers' own GGUF loader (which dequantizes everything) on the same file: for Llama (whose q / k rows
the converter interleaves), Qwen2 (biases, no interleaving) and Qwen3 (q / k norms), all-Q8_0, all-Q4_0 and mixed
files (another type per layer, an untied Q8_0 output layer, an F16 embedding). Logits agree within the kernels'
activation rounding, the model generates with hf_accel's caches, saves as an hf_accel checkpoint and reloads bit for
bit; bad files get a `ValueError` naming the problem."""

import pytest
import torch
import transformers
from gguf_files import write_gguf
from tiny_llama import tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_accel
from hf_accel import Engine, Int4Linear, Int8Linear, SamplingParams
from hf_accel.bench.main_rows import main_rows
from hf_accel.bench.models import load_bench_model
from hf_accel.reference import ASSETS_DIR
from hf_accel.server.served_engine import load_served_model

pytest.importorskip("gguf")


def tiny_qwen2() -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_qwen3() -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(3)
    # head_dim 128: transformers' GGUF config reader does not read qwen3's key_length (Qwen3's own head_dim is 128)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=128,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return transformers.Qwen3ForCausalLM(config).eval()


MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}
MIXED = {"blk.0.ffn_down.weight": "Q8_0", "blk.1.attn_v.weight": "F16", "output.weight": "Q8_0",
         "token_embd.weight": "F16"}
PROMPT = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def reference(path):
    """transformers' own GGUF load of the same file (every tensor dequantized to fp32)."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def relative_error(out, expected):
    return ((out - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind, types", [("Q8_0", None), ("Q4_0", None), ("Q4_0", MIXED)])
def test_packed_linears_multiply_by_the_weights_transformers_dequantizes(tmp_path, architecture, kind, types):
    path = write_gguf(MODELS[architecture](), tmp_path / "model.gguf", architecture, types, default=kind)
    model, expected = hf_accel.load_gguf(path), reference(path)
    main_class = Int8Linear if kind == "Q8_0" else Int4Linear
    expected_weights = expected.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear | Int8Linear | Int4Linear):
            continue
        gguf_type = (types or {}).get(_gguf_name(name, architecture), kind)
        if name == "lm_head" and gguf_type == kind and types is None:
            gguf_type = kind if not model.config.tie_word_embeddings else "F32"
        wanted = {"Q8_0": Int8Linear, "Q4_0": Int4Linear}.get(gguf_type, torch.nn.Linear)
        if name == "lm_head" and model.config.tie_word_embeddings:
            wanted = torch.nn.Linear  # tied to the (dequantized) embedding
        assert type(module) is wanted, (name, gguf_type)
        if wanted is not torch.nn.Linear:
            assert module.group_size == 32 and module.layout == "panels"
        weight = module.weight if wanted is torch.nn.Linear else module.dequantized_weight(torch.float32)
        assert torch.equal(weight, expected_weights[name + ".weight"]), name
    assert any(type(module) is main_class for module in model.modules())
    with torch.no_grad():
        logits = model(PROMPT).logits
        assert relative_error(logits, expected(PROMPT).logits) < 3e-2  # activations rounded to int8
        model.save_pretrained(tmp_path / "checkpoint")  # the mix of formats is kept (WeightOnlyConfig.module_formats)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
        assert [type(m) for m in reloaded.modules()] == [type(m) for m in model.modules()]
        assert torch.equal(reloaded(PROMPT).logits, logits)


def test_a_file_whose_only_packed_linear_is_the_output_layer(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "model.gguf", "llama", {"output.weight": "Q8_0"}, default="F16")
    model = hf_accel.load_gguf(path)
    assert isinstance(model.lm_head, Int8Linear) and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert torch.equal(model.lm_head.dequantized_weight(), reference(path).lm_head.weight)


def _gguf_name(module_name, architecture):
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    return gguf.get_tensor_name_map(arch, 2).get_name(module_name + ".weight", try_suffixes=(".weight",))


def test_load_model_reads_gguf_generates_with_hf_accel_caches_and_saves_as_a_checkpoint(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "model-Q4_0.gguf", "llama", default="Q4_0")
    model = hf_accel.load_model(str(path))
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)
    options = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(PROMPT, **options)
    for cache in ("paged", "sink"):
        config = {"window_length": 64, "num_sink_tokens": 4} if cache == "sink" else None
        assert torch.equal(model.generate(PROMPT, cache_implementation=cache, cache_config=config, **options), plain)
    model.save_pretrained(tmp_path / "checkpoint")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    assert isinstance(reloaded.model.layers[0].mlp.up_proj, Int4Linear)
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT).logits, model(PROMPT).logits)


def test_load_gguf_takes_a_dtype(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "model.gguf", "llama", default="Q8_0")
    model = hf_accel.load_gguf(path, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (2, 13)


def test_bad_files_are_value_errors_naming_the_problem(tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("not a gguf file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        hf_accel.load_gguf(text)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        hf_accel.load_gguf(tmp_path / "missing.gguf")
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        hf_accel.load_gguf(tmp_path / "gpt2.gguf")


def test_a_gguf_file_is_served_with_the_tokenizer_it_holds(tmp_path):
    """What `hf-accel serve --model x.gguf` (and `hf-accel bench --model x.gguf`) loads: the packed model and the
    file's tokenizer; the Engine decodes it as plain greedy generate does."""
    tokenizer = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    torch.manual_seed(2)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    path = write_gguf(transformers.LlamaForCausalLM(config).eval(), tmp_path / "model-Q8_0.gguf", "llama",
                      default="Q8_0", tokenizer=tokenizer)
    model, served_tokenizer = load_served_model(str(path), None, torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
    benched = load_bench_model(str(path))  # hf-accel bench --model x.gguf
    assert isinstance(benched.model.model.layers[0].self_attn.q_proj, Int8Linear) and benched.tokenizer is not None
    rows, notes = main_rows(benched)  # the weight rows would re-quantize nothing: left out, and said so
    assert not any("weights" in row.name for row in rows) and any("quantized already" in note for note in notes)
    text = "def parse_args(argv):\n    return  x  # \u00e9\n\tfoo"
    assert served_tokenizer(text).input_ids == tokenizer(text).input_ids
    prompt = tokenizer("import os\nimport sys\n", return_tensors="pt").input_ids
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
    out = Engine(model, served_tokenizer).generate([prompt[0].tolist()],
                                                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected.tolist()
