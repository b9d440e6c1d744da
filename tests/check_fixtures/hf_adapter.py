"""transformers' own GPT-2, Llama and Mistral classes behind kvports check's adapter interface,
called the usual way (keyword arguments: input_ids=, past_key_values=, use_cache=True), at the
weights' dtype (float64 included). The class follows the config: learned positions are GPT-2,
RoPE with a window Mistral, RoPE without one Llama. Nothing here computes the model: it only
renames the seed's weights to transformers' names. RESTART_POSITIONS = True passes
position_ids counted from 0 in every cached call, the position_offset mistake.
"""

import inspect
import warnings

import numpy as np
import torch

RESTART_POSITIONS = False
# transformers 5 renames the keyword to `cache` (past_key_values is deprecated, then removed): the one its forward has.
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)


def hf_model(config, dtype):
    import transformers

    common = dict(
        vocab_size=config["vocab_size"],
        tie_word_embeddings=config["tie_embeddings"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if config["positions"] == "learned":
        hf = transformers.GPT2Config(
            n_positions=config["max_seq_len"],
            n_embd=config["d_model"],
            n_layer=config["n_layers"],
            n_head=config["n_heads"],
            n_inner=config["ffn_hidden"],
            activation_function="gelu_new" if config["activation"] == "gelu_tanh" else "gelu",
            layer_norm_epsilon=config["norm_eps"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        model = transformers.GPT2LMHeadModel(hf)
    else:
        window = config["sliding_window"]
        kind = "Mistral" if window is not None else "Llama"
        hf = getattr(transformers, kind + "Config")(
            hidden_size=config["d_model"],
            intermediate_size=config["ffn_hidden"],
            num_hidden_layers=config["n_layers"],
            num_attention_heads=config["n_heads"],
            num_key_value_heads=config["n_kv_heads"],
            max_position_embeddings=config["max_seq_len"],
            rms_norm_eps=config["norm_eps"],
            rope_theta=config["rope_theta"],
            **({"sliding_window": window} if window is not None else {}),
            **common,
        )
        hf._attn_implementation = "eager"
        model = getattr(transformers, kind + "ForCausalLM")(hf)
    return model.to(dtype).eval()


def hf_names(config, weights):
    """The seed's names and layouts -> transformers' (GPT-2's Conv1D stores (in, out))."""
    w = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in weights.items()}
    out = {}
    if config["positions"] == "learned":
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = w["emb.weight"], w["pos.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = w["ln.weight"], w["ln.bias"]
        for i in range(config["n_layers"]):
            ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
            for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
                for part in ("weight", "bias"):
                    out[f"{theirs}{b}.{part}"] = w[f"{ours}{a}.{part}"]
            for a, b in (
                ("qkv", "attn.c_attn"),
                ("proj", "attn.c_proj"),
                ("ffn.0", "mlp.c_fc"),
                ("ffn.2", "mlp.c_proj"),
            ):
                out[f"{theirs}{b}.weight"] = w[f"{ours}{a}.weight"].T.contiguous()
                out[f"{theirs}{b}.bias"] = w[f"{ours}{a}.bias"]
        out["lm_head.weight"] = w.get("head.weight", w["emb.weight"])
        return out
    H, Hkv, Dh, F = (
        config["n_heads"],
        config["n_kv_heads"],
        config["d_model"] // config["n_heads"],
        config["ffn_hidden"],
    )
    out["model.embed_tokens.weight"], out["model.norm.weight"] = w["emb.weight"], w["ln.weight"]
    out["lm_head.weight"] = w.get("head.weight", w["emb.weight"])
    for i in range(config["n_layers"]):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = w[ours + "ln1.weight"]
        out[theirs + "post_attention_layernorm.weight"] = w[ours + "ln2.weight"]
        q, k, v = torch.split(w[ours + "qkv.weight"], [H * Dh, Hkv * Dh, Hkv * Dh])
        out[theirs + "self_attn.q_proj.weight"], out[theirs + "self_attn.k_proj.weight"] = q, k
        out[theirs + "self_attn.v_proj.weight"] = v
        out[theirs + "self_attn.o_proj.weight"] = w[ours + "proj.weight"]
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = torch.split(
            w[ours + "ffn.0.weight"], F
        )
        out[theirs + "mlp.down_proj.weight"] = w[ours + "ffn.2.weight"]
    return out


def load(config, weights):
    dtype = getattr(torch, str(next(iter(weights.values())).dtype))
    import transformers

    transformers.logging.set_verbosity_error()  # its deprecation notes are not the check's business
    model = hf_model(config, dtype)
    missing, unexpected = model.load_state_dict(hf_names(config, weights), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@torch.no_grad()
def full(model, tokens):
    return model(input_ids=torch.from_numpy(tokens), use_cache=False).logits


@torch.no_grad()
def step(model, tokens, state):
    import transformers

    cache = transformers.DynamicCache(config=model.config) if state is None else state
    kwargs = {}
    if RESTART_POSITIONS:
        kwargs["position_ids"] = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    keyword = "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"
    kwargs[keyword] = cache
    out = model(input_ids=torch.from_numpy(tokens), use_cache=True, **kwargs)
    return out.logits, cache
