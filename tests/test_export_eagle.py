"""An EAGLE head exported as vLLM's EAGLE-3 draft (`hf_accel.export.vllm_eagle`): the tensors vLLM's
`Eagle3LlamaForCausalLM` loads, under the names its weight mapper expects, computing what vLLM's layer computes
(re-derived here from vllm/model_executor/models/llama_eagle3.py with plain tensor ops); the config fields vLLM reads;
`export_vllm`'s choice of what `serve.sh` speculates with; and the errors for heads vLLM cannot load."""

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_accel import EagleHead, MedusaHeads
from hf_accel.export.vllm_eagle import export_vllm as export_eagle
from hf_accel.export.vllm import export_vllm

from test_export import float_model, run_serve_sh, tiny_folder

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 64, 4, 2, 16, 4, 300
VLLM_NAMES = {"fc.weight", "norm.weight"} | {f"midlayer.{name}.weight" for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "input_layernorm", "post_attention_layernorm", "hidden_norm")}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=128, rope_theta=5000.0)
    return LlamaForCausalLM(config).eval()


def random_head(model) -> EagleHead:
    head = EagleHead.for_model(model, feature_layers=(1, 2, 3))
    with torch.no_grad():
        for parameter in head.parameters():  # norms away from 1, so a norm read in the wrong place shows
            parameter.add_(0.2 * torch.randn_like(parameter))
    return head.eval()


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Neox-style rotary embedding of `x` `[heads, seq, D]` at `positions` `[seq]`."""
    dim = x.shape[-1]
    angles = positions[:, None].float() / theta ** (torch.arange(0, dim, 2).float() / dim)[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


def vllm_eagle3(tensors, feature, embeds, positions, eps=1e-6, theta=5000.0):
    """vLLM's EAGLE-3 draft layer over one causal sequence (`feature`, `embeds` `[seq, H]`): the pre-norm output
    the next draft step reads, and the normed state its LM head reads."""
    w = {name.removeprefix("midlayer."): t.float() for name, t in tensors.items()}
    x = torch.cat([rms(embeds, w["input_layernorm.weight"], eps), rms(feature, w["hidden_norm.weight"], eps)], -1)
    seq = x.shape[0]
    q = (x @ w["self_attn.q_proj.weight"].T).view(seq, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ w["self_attn.k_proj.weight"].T).view(seq, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = (x @ w["self_attn.v_proj.weight"].T).view(seq, KV_HEADS, HEAD_DIM).transpose(0, 1)
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(seq, -1)
    residual = feature + attended @ w["self_attn.o_proj.weight"].T
    m = rms(residual, w["post_attention_layernorm.weight"], eps)
    out = residual + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w[
        "mlp.down_proj.weight"].T
    return out, rms(out, w["norm.weight"], eps)


def test_tensors_are_the_ones_vllm_loads_and_compute_its_layer(llama, tmp_path):
    head = random_head(llama)
    folder = export_eagle(head, tmp_path / "eagle3", dtype=torch.float32)
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == VLLM_NAMES  # no lm_head / embed_tokens: vLLM shares the target's
    for name in ("q_proj", "k_proj", "v_proj"):
        assert tensors[f"midlayer.self_attn.{name}.weight"].shape[1] == 2 * HIDDEN  # [embedding; feature]
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    torch.manual_seed(1)
    seq = 12
    features = torch.randn(1, seq, 3 * HIDDEN)
    tokens = torch.randint(0, VOCAB, (1, seq))
    positions = torch.arange(seq)[None] + 5
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        fused = head.fc(features)
        embeds = llama.get_input_embeddings()(tokens)
        ours = head(fused, embeds, positions, causal, None)
        our_logits = head.logits(llama, ours)
    theirs, normed = vllm_eagle3(tensors, features[0] @ tensors["fc.weight"].T, embeds[0], positions[0])
    torch.testing.assert_close(ours[0], theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_logits[0], normed @ llama.lm_head.weight.T, atol=1e-4, rtol=1e-4)


def test_config_has_the_fields_vllm_reads(llama, tmp_path):
    head = random_head(llama)
    config = json.loads((export_eagle(head, tmp_path / "eagle3") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # registry: -> llama_eagle3.Eagle3LlamaForCausalLM
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # = hidden-state indices
    assert config["draft_vocab_size"] == config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is False
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert config["dtype"] == "float32" and config["rope_parameters"]["rope_theta"] == 5000.0


def test_heads_vllm_cannot_load_are_refused(tmp_path):
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB)
    head = EagleHead.for_model(Qwen3ForCausalLM(config))
    with pytest.raises(ValueError, match="eagle: vLLM's EAGLE-3 draft is a Llama layer.*'qwen3'"):
        export_eagle(head, tmp_path / "qwen3")
    assert not (tmp_path / "qwen3").exists()


def test_an_earlier_layout_asks_for_retraining(llama, tmp_path):
    head = random_head(llama)
    head.save_pretrained(tmp_path / "head")
    state = load_file(tmp_path / "head" / "eagle_head.safetensors")
    state["input_fc.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    save_file(state, tmp_path / "head" / "eagle_head.safetensors")
    with pytest.raises(ValueError, match="earlier layout.*retrain"):
        EagleHead.from_pretrained(tmp_path / "head", llama)


@pytest.fixture(scope="module")
def tiny_with_heads(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("tiny"))
    model = float_model(folder)
    EagleHead.for_model(model).save_pretrained(folder.parent / "eagle")
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(folder.parent / "medusa")
    return folder


def test_serve_sh_speculates_with_eagle3_when_a_head_is_exported(tiny_with_heads, tmp_path):
    pytest.importorskip("compressed_tensors")
    heads = tiny_with_heads.parent
    out = export_vllm(tmp_path / "out", model=tiny_with_heads, eagle=heads / "eagle", medusa=heads / "medusa")
    assert (out / "eagle3" / "model.safetensors").is_file() and (out / "medusa" / "model.safetensors").is_file()
    argv = run_serve_sh(out, tmp_path)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": f"{out.resolve()}/eagle3", "num_speculative_tokens": 5}
    readme = (out / "README.md").read_text()
    assert "`eagle3/`: an EAGLE-3 draft head" in readme and "`medusa/`: Medusa heads" in readme
    medusa = export_vllm(tmp_path / "medusa", model=tiny_with_heads, eagle=heads / "eagle", medusa=heads / "medusa",
                         speculative="medusa")
    argv = run_serve_sh(medusa, tmp_path)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "medusa"
    plain = export_vllm(tmp_path / "plain", model=tiny_with_heads, eagle=heads / "eagle", speculative="none")
    assert "--speculative-config" not in run_serve_sh(plain, tmp_path)


def test_bad_speculative_choices_name_the_argument(tiny_with_heads, tmp_path):
    with pytest.raises(ValueError, match="speculative must be one of 'eagle3', 'medusa', 'none', got 'eagle'"):
        export_vllm(tmp_path / "a", model=tiny_with_heads, speculative="eagle")
    with pytest.raises(ValueError, match="speculative='eagle3' needs eagle heads to export"):
        export_vllm(tmp_path / "b", model=tiny_with_heads, speculative="eagle3")
    with pytest.raises(ValueError, match="eagle .* is not an EAGLE head folder"):
        export_vllm(tmp_path / "c", model=tiny_with_heads, eagle=tmp_path)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_cli_exports_an_eagle_head(tiny_with_heads, tmp_path, capsys):
    from hf_accel.cli import main

    out = tmp_path / "cli"
    assert main(["export", "--format", "vllm", "--model", str(tiny_with_heads), "--eagle",
                 str(tiny_with_heads.parent / "eagle"), str(out)]) == 0
    assert (out / "eagle3" / "config.json").is_file()
    subprocess.run(["bash", "-n", str(out / "serve.sh")], check=True)
    assert main(["export", "--format", "vllm", "--model", str(tiny_with_heads), "--speculative", "medusa",
                 str(tmp_path / "none")]) == 2
    assert "speculative='medusa' needs medusa heads" in capsys.readouterr().err
