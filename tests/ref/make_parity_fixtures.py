#!/usr/bin/env python3
"""Write Qwen3.5 parity fixtures with Hugging Face transformers.

    python tests/ref/make_parity_fixtures.py --out tests/fixtures/parity
    python tests/ref/make_parity_fixtures.py --out tests/fixtures/parity --verify-only

For every case this writes <out>/<case>/ with the checkpoint as
`save_pretrained` writes it (see CASES for the few documented edits) and
expected.json with the reference outputs, then reloads every checkpoint from
disk and checks it against expected.json. It also runs an independent float64
re-implementation of the model written from the facts in tests/ref/README.md,
so those facts are checked on every run.

Everything is deterministic: fixed seeds, fp32 compute on CPU, eager attention.
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

VOCAB = 256

# Shared tiny text-config fields; each case overrides some of them.
BASE_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

CASES = [
    dict(
        name="gqa_untied",
        seed=1001,
        description=(
            "qwen3_5_text, f32, untied lm_head, GQA 4 q-heads / 2 kv-heads, linear nk=2 nv=4 (r=2), "
            "partial_rotary_factor 0.25, head_dim 16, dk=dv=8. config.json has NO layer_types and no "
            "full_attention_interval: the default interval 4 gives layers 0-2 linear, 3 full."
        ),
        text=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
        drop_config_keys=["layer_types"],
        lengths=[65, 1, 150],
    ),
    dict(
        name="rot_half_tied",
        seed=1002,
        description=(
            "qwen3_5_text, f32, tie_word_embeddings=true (no lm_head.weight on disk), explicit layer_types "
            "[full, linear, full, linear], partial_rotary_factor 0.5 with head_dim 32 (rotary dim 16), "
            "rope_theta 1e6, MQA 2 q-heads / 1 kv-head, linear nk=nv=2, dk=dv=16, rms_norm_eps 1e-5."
        ),
        text=dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
        ),
        lengths=[64, 9, 63],
    ),
    dict(
        name="bf16",
        seed=1003,
        description=(
            "qwen3_5_text saved in bfloat16 (config dtype bfloat16, every tensor BF16 on disk). References "
            "are fp32 compute from the bf16 weights upcast to f32. Layers linear,linear,linear,full (interval "
            "4, layer_types written), dk=16 != dv=8, linear nk=2 nv=4, GQA 4/2."
        ),
        text=dict(
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        dtype=torch.bfloat16,
        lengths=[63, 130, 5],
    ),
    dict(
        name="sharded",
        seed=1004,
        description=(
            "qwen3_5_text, f32, saved with max_shard_size=100KB: model.safetensors.index.json plus 3 "
            "shards. config.json has full_attention_interval 2 and NO layer_types (layers linear, full, "
            "linear, full). MHA 2/2 heads, linear nk=nv=2, dk=8 != dv=16."
        ),
        text=dict(
            num_attention_heads=2,
            num_key_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            full_attention_interval=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        drop_config_keys=["layer_types"],
        add_config_keys={"full_attention_interval": 2},
        max_shard_size="100KB",
        lengths=[129, 128, 2],
    ),
    dict(
        name="wrapper",
        seed=1005,
        description=(
            "qwen3_5 wrapper written by the real Qwen3_5ForConditionalGeneration: text config under "
            "text_config, tiny vision_config, weights under model.language_model.*, lm_head.weight, "
            "model.visual.* tensors, plus mtp.* tensors added after saving (a loader must ignore "
            "model.visual.* and mtp.*). Text: MQA 2 q-heads / 1 kv-head, head_dim 32, partial_rotary_factor 0.25 (rotary dim 8), "
            "rope_theta 1e7 with mrope_section [2,1,1] / mrope_interleaved (no effect for text), "
            "layer_types and full_attention_interval 4 both present."
        ),
        text=dict(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=0.25,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),
        add_text_config_keys={"full_attention_interval": 4},
        wrapper=True,
        lengths=[1, 64, 33],
    ),
]

VISION = dict(
    depth=1,
    hidden_size=16,
    num_heads=2,
    intermediate_size=32,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=4,
)


# ----------------------------------------------------------------------------
# building and randomizing


def text_config(case):
    kw = dict(BASE_TEXT)
    kw.update(case["text"])
    cfg = Qwen3_5TextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model, gen):
    """Overwrite every parameter so nothing keeps a default that would hide a bug."""

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            leaf = name.split(".")[-2:]
            if ".visual." in name or name.startswith("visual."):
                normal(p, 0.1)
            elif name.endswith("A_log"):
                # A in [0.02, 2]: decays from ~0.99 (long memory across chunks) to ~0.1 per step.
                a = torch.rand(p.shape, generator=gen) * (2.0 - 0.02) + 0.02
                p.copy_(torch.log(a))
            elif name.endswith("dt_bias"):
                normal(p, 0.5)
            elif name.endswith("conv1d.weight"):
                normal(p, 0.4)
            elif name.endswith("linear_attn.norm.weight"):
                normal(p, 0.2, mean=1.0)  # gated norm: plain w, default ones
            elif leaf[-1] == "weight" and (
                leaf[0] in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm")
            ):
                normal(p, 0.2)  # (1 + w) norms, default zeros
            elif leaf[-1] == "weight" and (
                leaf[0].endswith("_proj") or leaf[0].startswith("in_proj_") or leaf[0] in ("embed_tokens", "lm_head")
            ):
                normal(p, 0.2 if leaf[0] != "embed_tokens" else 0.3)
            else:
                raise SystemExit(f"randomize: no rule for parameter {name}")


def build_text_model(case):
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    cfg = text_config(case)
    model = Qwen3_5ForCausalLM(cfg).eval()
    randomize(model, gen)
    return model, gen


def make_sequences(case, gen):
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in case["lengths"]]


# ----------------------------------------------------------------------------
# references


def r9(x):
    return float(f"{x:.9g}")


def run_text_model(model, ids):
    """Batch 1, no padding. Returns fp32 logits [T, V] and post-final-norm hidden [T, H]."""
    with torch.no_grad():
        inp = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=inp, output_hidden_states=True)
        hidden = model.model(input_ids=inp).last_hidden_state
        # hidden_states[-1] is the post-final-norm state too (same tensor as last_hidden_state)
        assert torch.equal(out.hidden_states[-1], hidden)
        return out.logits[0].float(), hidden[0].float()


def logprobs_of(logits, ids):
    lp = torch.log_softmax(logits.double(), dim=-1)
    return [None] + [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def references(model, seqs):
    res = dict(sequences=seqs, logprobs=[], final_hidden=[], logits_last=[])
    for ids in seqs:
        logits, hidden = run_text_model(model, ids)
        res["logprobs"].append([None if v is None else r9(v) for v in logprobs_of(logits, ids)])
        res["final_hidden"].append([[r9(v) for v in row] for row in hidden.tolist()])
        res["logits_last"].append([r9(v) for v in logits[-1].tolist()])
    return res


# ----------------------------------------------------------------------------
# independent re-implementation (float64) of the facts in tests/ref/README.md


def independent_forward(sd, cfg, ids, prefix="model."):
    """Plain, token-by-token Qwen3.5 text forward from a state dict; returns (logits, final hidden)."""
    d = torch.float64
    W = lambda k: sd[prefix + k].to(d)  # noqa: E731
    H = cfg["hidden_size"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    n_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n_layers)
    ]
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg.get("linear_conv_kernel_dim", 4)
    T = len(ids)

    def rms(x, w, one_plus=True):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return y * ((1.0 + w) if one_plus else w)

    def linear(x, w):
        return x @ w.T

    h = W("embed_tokens.weight")[torch.tensor(ids)]
    pos = torch.arange(T, dtype=d)
    for i in range(n_layers):
        p = f"layers.{i}."
        x = rms(h, W(p + "input_layernorm.weight"))
        if layer_types[i] == "full_attention":
            qg = linear(x, W(p + "self_attn.q_proj.weight")).view(T, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]  # per head: [query(hd) | gate(hd)]
            k = linear(x, W(p + "self_attn.k_proj.weight")).view(T, nkv, hd)
            v = linear(x, W(p + "self_attn.v_proj.weight")).view(T, nkv, hd)
            q = rms(q, W(p + "self_attn.q_norm.weight"))
            k = rms(k, W(p + "self_attn.k_norm.weight"))
            rot = int(hd * prf)
            inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=d) / rot)
            ang = pos[:, None] * inv_freq[None, :]  # [T, rot/2]
            cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

            def rope(t):
                a, b, rest = t[..., : rot // 2], t[..., rot // 2 : rot], t[..., rot:]
                return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)

            q, k = rope(q), rope(k)
            out = torch.zeros(T, nh, hd, dtype=d)
            for hh in range(nh):
                kv = hh // (nh // nkv)
                s = (q[:, hh] @ k[:, kv].T) * hd**-0.5
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                out[:, hh] = torch.softmax(s, -1) @ v[:, kv]
            mix = linear((out * torch.sigmoid(gate)).reshape(T, nh * hd), W(p + "self_attn.o_proj.weight"))
        else:
            la = p + "linear_attn."
            qkv = linear(x, W(la + "in_proj_qkv.weight"))  # [T, 2*nk*dk + nv*dv]
            cw = W(la + "conv1d.weight")[:, 0, :]  # [C, K]; cw[:, K-1] multiplies the current token
            padded = torch.cat([torch.zeros(K - 1, qkv.shape[1], dtype=d), qkv], 0)
            conv = sum(padded[j : j + T] * cw[:, j] for j in range(K))
            conv = F.silu(conv)
            q = conv[:, : nk * dk].view(T, nk, dk)
            k = conv[:, nk * dk : 2 * nk * dk].view(T, nk, dk)
            v = conv[:, 2 * nk * dk :].view(T, nv, dv)
            z = linear(x, W(la + "in_proj_z.weight")).view(T, nv, dv)
            beta = torch.sigmoid(linear(x, W(la + "in_proj_b.weight")))  # [T, nv]
            g = -torch.exp(W(la + "A_log")) * F.softplus(linear(x, W(la + "in_proj_a.weight")) + W(la + "dt_bias"))
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            o = torch.zeros(T, nv, dv, dtype=d)
            r = nv // nk
            for j in range(nv):
                S = torch.zeros(dk, dv, dtype=d)
                for t in range(T):
                    kt, qt = k[t, j // r], q[t, j // r]
                    S = torch.exp(g[t, j]) * S
                    delta = beta[t, j] * (v[t, j] - S.T @ kt)
                    S = S + torch.outer(kt, delta)
                    o[t, j] = S.T @ qt
            o = rms(o, W(la + "norm.weight"), one_plus=False) * F.silu(z)
            mix = linear(o.reshape(T, nv * dv), W(la + "out_proj.weight"))
        h = h + mix
        x = rms(h, W(p + "post_attention_layernorm.weight"))
        h = h + linear(F.silu(linear(x, W(p + "mlp.gate_proj.weight"))) * linear(x, W(p + "mlp.up_proj.weight")),
                       W(p + "mlp.down_proj.weight"))
    hidden = rms(h, W("norm.weight"))
    lm = sd.get("lm_head.weight")
    lm = W("embed_tokens.weight") if lm is None else lm.to(d)
    return hidden @ lm.T, hidden


def read_checkpoint(case_dir):
    """All tensors of a checkpoint dir (single file or sharded), as saved."""
    sd = {}
    index = os.path.join(case_dir, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    for f in files:
        sd.update(load_file(os.path.join(case_dir, f)))
    return sd


# ----------------------------------------------------------------------------
# writing


def fix_config(path, case):
    cfg = json.load(open(path))
    for k in case.get("drop_config_keys", []):
        cfg.pop(k, None)
    cfg.update(case.get("add_config_keys", {}))
    if "add_text_config_keys" in case:
        cfg["text_config"].update(case["add_text_config_keys"])
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def add_mtp_tensors(case_dir, hidden, gen):
    """Real Qwen3.5 checkpoints carry a multi-token-prediction head under mtp.*; add a tiny fake one."""
    path = os.path.join(case_dir, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    sd = load_file(path)
    extra = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.norm.weight": (hidden,),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.layers.0.input_layernorm.weight": (hidden,),
        "mtp.layers.0.mlp.up_proj.weight": (8, hidden),
    }
    for k, shape in extra.items():
        sd[k] = torch.randn(shape, generator=gen) * 0.1
    save_file(sd, path, metadata=meta)


def write_case(case, out):
    case_dir = os.path.join(out, case["name"])
    if os.path.exists(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)

    text_model, gen = build_text_model(case)
    seqs = make_sequences(case, gen)

    if case.get("wrapper"):
        tcfg = text_model.config.to_dict()
        for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"):
            tcfg.pop(k, None)
        vision = dict(VISION, out_hidden_size=text_model.config.hidden_size)
        wcfg = Qwen3_5Config(text_config=tcfg, vision_config=vision, tie_word_embeddings=False)
        wcfg._attn_implementation = "eager"
        wrapper = Qwen3_5ForConditionalGeneration(wcfg).eval()
        with torch.no_grad():
            missing = wrapper.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
            assert not missing.missing_keys and not missing.unexpected_keys
            wrapper.lm_head.weight.copy_(text_model.lm_head.weight)
            for name, p in wrapper.named_parameters():
                if ".visual." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        wrapper.save_pretrained(case_dir)
        add_mtp_tensors(case_dir, text_model.config.hidden_size, gen)
        ref_model = text_model
    elif case.get("dtype") == torch.bfloat16:
        # fp32 compute from the bf16-rounded weights. A fresh fp32 model is used because
        # model.to(bf16).to(fp32) would also round the (non-persistent) RoPE inv_freq buffer.
        rounded = {k: v.to(torch.bfloat16).float() for k, v in text_model.state_dict().items()}
        ref_model = Qwen3_5ForCausalLM(text_config(case)).eval()
        ref_model.load_state_dict(rounded, strict=True)
        text_model.to(torch.bfloat16).save_pretrained(case_dir)
    else:
        kw = {"max_shard_size": case["max_shard_size"]} if "max_shard_size" in case else {}
        text_model.save_pretrained(case_dir, **kw)
        ref_model = text_model

    fix_config(os.path.join(case_dir, "config.json"), case)

    res = references(ref_model, seqs)
    expected = {
        "case": case["name"],
        "description": case["description"],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        **res,
    }
    with open(os.path.join(case_dir, "expected.json"), "w") as f:
        # one top-level key per line; the arrays themselves are compact
        f.write("{\n")
        items = list(expected.items())
        for i, (k, v) in enumerate(items):
            f.write(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}{',' if i + 1 < len(items) else ''}\n")
        f.write("}\n")

    lps = [v for row in res["logprobs"] for v in row if v is not None]
    mean = sum(lps) / len(lps)
    std = math.sqrt(sum((v - mean) ** 2 for v in lps) / len(lps))
    print(f"{case['name']}: lengths {case['lengths']}, logprob mean {mean:.3f} std {std:.3f}")
    assert std > 0.3, f"{case['name']}: log-probs too flat (std {std:.3f})"


# ----------------------------------------------------------------------------
# verification from disk


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def max_abs_diff(a, b):
    m = 0.0
    for x, y in zip(a, b):
        if isinstance(x, list):
            assert len(x) == len(y)
            m = max(m, max_abs_diff(x, y))
        elif x is None or y is None:
            assert x is None and y is None
        else:
            m = max(m, abs(x - y))
    return m


def verify_case(case, out):
    case_dir = os.path.join(out, case["name"])
    exp = json.load(open(os.path.join(case_dir, "expected.json")))
    seqs = exp["sequences"]
    assert [len(s) for s in seqs] == case["lengths"]

    loaded = []
    model, info = AutoModelForCausalLM.from_pretrained(
        case_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(model, Qwen3_5ForCausalLM), type(model)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    loaded.append(("AutoModelForCausalLM", model.eval()))
    if case.get("wrapper"):
        w, info = Qwen3_5ForConditionalGeneration.from_pretrained(
            case_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        loaded.append(("Qwen3_5ForConditionalGeneration", w.eval()))

    worst_reload = 0.0
    for label, m in loaded:
        for i, ids in enumerate(seqs):
            with torch.no_grad():
                inp = torch.tensor([ids])
                logits = m(input_ids=inp).logits[0].float()
                hidden = m.model(input_ids=inp).last_hidden_state[0]  # post-final-norm
            d_lp = max_abs_diff(logprobs_of(logits, ids), exp["logprobs"][i])
            d_h = max_abs_diff(hidden.tolist(), exp["final_hidden"][i])
            d_l = max_abs_diff(logits[-1].tolist(), exp["logits_last"][i])
            # Log-probs must match to 1e-6. Hidden/logits get 1e-5: for a 1-token input torch's fp32
            # matrix-vector path rounds differently depending on where the weights sit in memory (freshly
            # loaded vs built in place), and the gated norm amplifies that ulp-level noise.
            assert d_lp < 1e-6 and d_h < 1e-5 and d_l < 1e-5, (case["name"], label, i, d_lp, d_h, d_l)
            worst_reload = max(worst_reload, d_lp, d_h, d_l)

    # the independent float64 implementation, straight from the safetensors files
    cfg = json.load(open(os.path.join(case_dir, "config.json")))
    sd = read_checkpoint(case_dir)
    if cfg["model_type"] == "qwen3_5":
        tie = cfg.get("tie_word_embeddings", False)
        cfg = cfg["text_config"]
        prefix = "model.language_model."
    else:
        tie = cfg.get("tie_word_embeddings", False)
        prefix = "model."
    assert ("lm_head.weight" in sd) == (not tie)
    worst = 0.0
    for i, ids in enumerate(seqs):
        logits, hidden = independent_forward(sd, cfg, ids, prefix=prefix)
        lp = logprobs_of(logits, ids)
        worst = max(worst, max_abs_diff(lp, exp["logprobs"][i]), max_abs_diff(hidden.tolist(), exp["final_hidden"][i]))
    # fp32 rounding in the reference, amplified where the gated norm rescales small outputs, is ~1e-4
    assert worst < 5e-4, (case["name"], "independent implementation differs", worst)

    size = dir_size(case_dir)
    files = sorted(os.listdir(case_dir))
    print(
        f"verified {case['name']}: {size / 1024:.0f} KiB, reload max diff {worst_reload:.1e}, "
        f"independent f64 max diff {worst:.1e}, files {files}"
    )
    assert size < 400 * 1024, f"{case['name']} too big: {size}"
    return size, files


def write_manifest(out, sizes):
    manifest = {
        "generated_by": "tests/ref/make_parity_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "cases": [
            {
                "name": c["name"],
                "description": c["description"],
                "sequence_lengths": c["lengths"],
                "files": sizes[c["name"]][1],
                "bytes": sizes[c["name"]][0],
            }
            for c in CASES
        ],
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory, e.g. tests/fixtures/parity")
    ap.add_argument("--verify-only", action="store_true", help="only check existing fixtures")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    args = ap.parse_args()

    torch.set_num_threads(1)  # reproducible CPU reductions
    transformers.logging.set_verbosity_error()
    cases = [c for c in CASES if not args.case or c["name"] in args.case]
    os.makedirs(args.out, exist_ok=True)
    if not args.verify_only:
        for c in cases:
            write_case(c, args.out)
    sizes = {c["name"]: verify_case(c, args.out) for c in cases}
    if not args.verify_only and not args.case:
        write_manifest(args.out, sizes)
    total = sum(s for s, _ in sizes.values())
    print(f"total {total / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
