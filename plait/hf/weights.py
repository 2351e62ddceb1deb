"""Hugging Face weights (Llama and its relatives): plait names and RoPE order <-> transformers',
safetensors in and out.

Parameter names (plait -> Hugging Face):
    tok_embeddings.weight                   -> model.embed_tokens.weight
    layers.N.attention.w{q,k,v,o}.{weight,bias} -> model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}
    layers.N.attention.{q,k}_norm.weight    -> model.layers.N.self_attn.{q,k}_norm.weight (per head)
    layers.N.attention.{q,k}_proj_norm.weight -> model.layers.N.self_attn.{q,k}_norm.weight (whole projection)
    layers.N.feed_forward.w1/w3/w2.{weight,bias} -> model.layers.N.mlp.gate_proj/up_proj/down_proj.{...}
    layers.N.feed_forward.router.gate.weight -> model.layers.N.mlp.gate.weight (Qwen3-MoE;
                                               Mixtral: block_sparse_moe.gate.weight)
    layers.N.feed_forward.experts.w1/w3/w2  -> model.layers.N.mlp.experts.E.gate_proj/up_proj/down_proj.weight
                                               (Mixtral: block_sparse_moe.experts.E.w1/w3/w2.weight),
                                               one [E, ...] tensor <-> E tensors
    DeepSeek-V3: layers.N.attention.wq_a/wq_b/wkv_a/wkv_b -> model.layers.N.self_attn.q_a_proj/q_b_proj/
                                               kv_a_proj_with_mqa/kv_b_proj, q_a_norm/kv_a_norm ->
                                               q_a_layernorm/kv_a_layernorm (RoPE entries kept in place:
                                               DeepSeek rotates interleaved pairs too),
             layers.N.feed_forward.shared.w1/w3/w2 -> model.layers.N.mlp.shared_experts.gate/up/down_proj,
             layers.N.feed_forward.router.bias (a buffer) -> model.layers.N.mlp.gate.e_score_correction_bias
    gpt-oss: layers.N.attention.core.sinks  -> model.layers.N.self_attn.sinks
             layers.N.feed_forward.router.gate.{weight,bias} -> model.layers.N.mlp.router.{weight,bias}
             layers.N.feed_forward.experts.w1/w3 -> model.layers.N.mlp.experts.gate_up_proj [E, dim, 2 x hidden]
                                               (transposed; gate and up columns interleaved), w2 -> down_proj
                                               [E, hidden, dim] (transposed), b1/b3 -> gate_up_proj_bias
                                               (interleaved), b2 -> down_proj_bias
             mtp.0.block.* (the MTP module's block) -> model.layers.<n_layers>.* as a block's, mtp.0.enorm/hnorm/
                                               eh_proj -> model.layers.<n_layers>.enorm/hnorm/eh_proj, mtp.0.norm ->
                                               model.layers.<n_layers>.shared_head.norm (export also writes
                                               its copies of the embedding and output layer there)
    layers.N.attention_norm.weight          -> model.layers.N.input_layernorm.weight
                                               (post_norm: post_attention_layernorm.weight)
    layers.N.ffn_norm.weight                -> model.layers.N.post_attention_layernorm.weight
                                               (post_norm: post_feedforward_layernorm.weight)
    Llama 4: feed_forward.* as itself (feed_forward.gate_proj, ...), feed_forward.router.gate ->
             feed_forward.router, feed_forward.shared.* -> feed_forward.shared_expert.*, its experts
             fused as gpt-oss's (gate_up_proj: gate then up, not interleaved); q and k not reordered
             (its RoPE is Meta's interleaved pairs)
    Qwen3-Next and Qwen3.5: q/k/v (Qwen3-Next: z, b, a too) and the convolutions of a linear block,
             and a full block's query and output gate, are parts of its tensors (plait/hf/hybrid.py);
             layers.N.attention.* of a linear block -> model.layers.N.linear_attn.*; the shared expert
             (gated) -> mlp.shared_expert(_gate)
    Gemma 3's sandwich: attention_norm, post_attention_norm, ffn_norm, post_ffn_norm -> input_layernorm,
                                               post_attention_layernorm, pre_feedforward_layernorm,
                                               post_feedforward_layernorm
    Kimi Linear: a linear block's and a sparse block's own names, plait/hf/kimi.py
    norm.weight                             -> model.norm.weight
    output.weight                           -> lm_head.weight

RoPE's order of q and k's rows differs between plait and Hugging Face: plait/hf/rope_order.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plait import jsonl
from plait.config import ConfigError
from plait.file_names import first_stray
from plait.hf.config import describe_difference
from plait.hf.config import model_args as hf_model_args
from plait.hf.hybrid import (HYBRIDS, QWEN_HYBRIDS, fused_part, fused_whole, holder, hybrid_name, on_disk,
                             qwen_mtp_name)
from plait.hf.kimi import SPARSE, disk_shape, stored_names
from plait.hf.rope_order import LAYER, from_hf_rope_order, rope_reordered, to_hf_rope_order
from plait.models.args import ModelArgs

LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
    "attention.q_proj_norm": "self_attn.q_norm", "attention.k_proj_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.router.gate": "mlp.gate", "attention.core": "self_attn",
    # DeepSeek-V3's latent attention and shared experts
    "attention.wq_a": "self_attn.q_a_proj", "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
    "feed_forward.shared.w1": "mlp.shared_experts.gate_proj", "feed_forward.shared.w3": "mlp.shared_experts.up_proj",
    "feed_forward.shared.w2": "mlp.shared_experts.down_proj",
}
ROUTER_BIAS = "feed_forward.router.bias"  # a buffer: DeepSeek-V3's e_score_correction_bias
EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
           "feed_forward.experts.w2": "down_proj"}
MIXTRAL = "block_sparse_moe"  # Mixtral's name for the MoE layer; its experts keep Meta's w1/w2/w3
# gpt-oss's experts: plait's tensor -> (its tensor, which interleaved half: 0 gate, 1 up; None: whole)
GPT_OSS_EXPERTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
                   "b1": ("gate_up_proj_bias", 0), "b3": ("gate_up_proj_bias", 1), "b2": ("down_proj_bias", None)}
# The families whose experts are fused (gate and up in one tensor, E experts in one): where they are
FUSED_EXPERTS = {"gpt_oss": "mlp.experts", "llama4_text": "feed_forward.experts"}
LLAMA4_NAMES = {"feed_forward.router.gate": "feed_forward.router",
                "feed_forward.shared.w1": "feed_forward.shared_expert.gate_proj",
                "feed_forward.shared.w3": "feed_forward.shared_expert.up_proj",
                "feed_forward.shared.w2": "feed_forward.shared_expert.down_proj"}
BLOCK_NORMS = {"pre": {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
               "post": {"attention_norm": "post_attention_layernorm", "ffn_norm": "post_feedforward_layernorm"},
               "sandwich": {"attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


MTP_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}


def mtp_as_layer(name: str, args: ModelArgs) -> str:
    """An MTP module's parameter under the name of the block it is (`layers.<n_layers + k>.`):
    DeepSeek-V3 stores it as one more layer. Other names as they are."""
    if not name.startswith("mtp."):
        return name
    _, k, rest = name.split(".", 2)
    return f"layers.{args.n_layers + int(k)}.{rest.removeprefix('block.') if rest.startswith('block.') else rest}"


def hf_names(name: str, args: ModelArgs) -> list[str]:
    """The Hugging Face tensors of a plait parameter: one, or an expert tensor's E slices."""
    return [qwen_mtp_name(hf, args) for hf in layer_names(mtp_as_layer(name, args), args)]


def layer_names(name: str, args: ModelArgs) -> list[str]:
    """`hf_names` with an MTP module's as a layer after the model's (DeepSeek-V3's way)."""
    if (held := held_with_others(name, args)) is not None:
        return on_disk(args, held[0])
    index, rest = LAYER.match(name).groups() if name not in TOP_NAMES else (None, "")
    if args.family in FUSED_EXPERTS and rest.startswith("feed_forward.experts."):
        return [f"model.layers.{index}.{FUSED_EXPERTS[args.family]}.{GPT_OSS_EXPERTS[rest.rsplit('.', 1)[1]][0]}"]
    if rest in EXPERTS:
        if args.family in ("mixtral", "kimi_linear"):
            return [f"model.layers.{index}.{MIXTRAL}.experts.{e}.{rest.rsplit('.', 1)[1]}.weight"
                    for e in range(args.n_experts)]
        return [f"model.layers.{index}.mlp.experts.{e}.{EXPERTS[rest]}.weight" for e in range(args.n_experts)]
    return [hf_name(name, args)]


def hf_name(name: str, args: ModelArgs) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    index, rest = LAYER.match(name).groups()
    if int(index) >= args.n_layers and rest.rsplit(".", 1)[0] in MTP_NAMES:  # (the MTP module's own)
        return f"model.layers.{index}.{MTP_NAMES[rest.rsplit('.', 1)[0]]}.{rest.rsplit('.', 1)[1]}"
    if rest == ROUTER_BIAS:
        return f"model.layers.{index}.{SPARSE if args.family == 'kimi_linear' else 'mlp'}.gate.e_score_correction_bias"
    if args.family in HYBRIDS and (named := hybrid_name(args, int(index), rest)):
        return f"model.layers.{index}.{named}"
    module, kind = rest.rsplit(".", 1)
    norms = "sandwich" if args.sandwich_norm else "post" if args.post_norm else "pre"
    hf_module = (LAYER_NAMES | BLOCK_NORMS[norms])[module]
    if args.family == "mixtral":
        hf_module = hf_module.replace("mlp.", f"{MIXTRAL}.")
    if args.family == "gpt_oss" and module == "feed_forward.router.gate":
        hf_module = "mlp.router"
    if args.family == "llama4_text":  # (its MLP and MoE are feed_forward, the shared expert one)
        hf_module = LLAMA4_NAMES.get(module, hf_module.replace("mlp.", "feed_forward."))
    return f"model.layers.{index}.{hf_module}.{kind}"


def fused_expert(name: str, tensor: torch.Tensor, family: str) -> torch.Tensor:
    """A plait expert tensor (w or b) from gpt-oss's or Llama 4's fused one: its half of the columns
    (gpt-oss's gate and up interleaved, Llama 4's one after the other), and a weight transposed to
    plait's [E, out, in]."""
    _, half = GPT_OSS_EXPERTS[name.rsplit(".", 1)[1]]
    if half is not None:
        tensor = tensor[..., half::2] if family == "gpt_oss" else tensor.chunk(2, -1)[half]
    return tensor.transpose(1, 2) if tensor.ndim == 3 else tensor


def fused_merged(state_dict: dict[str, torch.Tensor], name: str, family: str) -> torch.Tensor | None:
    """gpt-oss's or Llama 4's tensor for plait's expert tensor `name`: w1 with w3 (b1 with b3),
    interleaved or one after the other, weights transposed; None for w3 and b3 (written with w1 and b1)."""
    kind = name.rsplit(".", 1)[1]
    if kind in ("w3", "b3"):
        return None

    def theirs(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(1, 2) if tensor.ndim == 3 else tensor

    tensor = theirs(state_dict[name])
    if kind in ("w1", "b1"):
        up = theirs(state_dict[name[:-1] + "3"])
        tensor = torch.stack([tensor, up], dim=-1).flatten(-2) if family == "gpt_oss" else torch.cat([tensor, up], -1)
    return tensor


def held_with_others(name: str, args: ModelArgs) -> tuple[str, list[str], tuple[int, ...], int] | None:
    """The hybrids: the tensor on disk that holds plait's `name` with others (plait/hf/hybrid.py),
    their names (as `name` is named: an MTP block's too), their rows per group and the groups; None elsewhere."""
    layer = LAYER.match(mtp_as_layer(name, args))
    held = holder(args, int(layer.group(1)), layer.group(2)) if layer and args.family in HYBRIDS else None
    if held is None:
        return None
    (whole, names, rows, groups), block = held, int(layer.group(1))
    prefix = f"mtp.{block - args.n_layers}.block." if block >= args.n_layers else f"layers.{block}."
    return qwen_mtp_name(f"model.layers.{block}.{whole}", args), [prefix + n for n in names], rows, groups


def write_weights(state_dict: dict[str, torch.Tensor], args: ModelArgs, out: Path, dtype: torch.dtype,
                  shard_bytes: int) -> list[str]:
    """Write the weights of a full plait state dict as safetensors into `out`: one
    model.safetensors, or shards of at most `shard_bytes` and their index as transformers
    writes them. (A tied model has no output.weight: its embedding is all there is, as in
    the folders transformers writes.)"""
    tensors, parts = {}, {}
    for name, tensor in state_dict.items():
        if args.family in FUSED_EXPERTS and ".experts." in name:
            merged = fused_merged(state_dict, name, args.family)
            if merged is not None:
                tensors[hf_names(name, args)[0]] = merged.to(dtype).contiguous()
            continue
        if rope_reordered(name, args):
            tensor = to_hf_rope_order(tensor, args.head_dim, args.rope_dim)
        if (held := held_with_others(name, args)) is not None:  # (written once it has every part)
            whole, names, rows, groups = held
            parts[name] = tensor
            if all(n in parts for n in names):
                merged = fused_whole([parts[n] for n in names], rows, groups, whole.endswith("conv1d.weight"))
                stored = on_disk(args, whole)
                for hf, piece in zip(stored, merged.split(list(rows)) if len(stored) > 1 else [merged]):
                    tensors[hf] = piece.to(dtype).contiguous()
            continue
        names = hf_names(name, args)
        for hf, piece in zip(names, tensor.unbind(0) if len(names) > 1 else [tensor]):
            tensors[hf] = piece.reshape(disk_shape(args, hf) or piece.shape).to(dtype).contiguous()
    for k in range(args.mtp_layers * (args.family not in QWEN_HYBRIDS)):  # DeepSeek-V3's MTP layer holds copies
        # of the embedding and output layer
        tensors[f"model.layers.{args.n_layers + k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{args.n_layers + k}.shared_head.head.weight"] = \
            tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0  # of the last shard
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    out.mkdir(parents=True, exist_ok=True)
    names = [WEIGHTS] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=1))
    return names


def weight_files(folder: Path, option: str) -> dict[str, Path]:
    """Hugging Face name -> the file holding it: from the index when there is one (each listed
    shard must exist), else from the headers of every .safetensors file. Reads no tensor."""
    if (folder / INDEX).exists():
        index = jsonl.document(folder / INDEX, option)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"{option}: {folder / INDEX}'s weight_map is not an object of tensor name -> file name")
        # follow_links: a hub snapshot's shards are links into its blob store
        if stray := first_stray(folder, weight_map.values(), follow_links=True):
            raise ConfigError(f"{option}: {folder / INDEX} names {stray}; its shards must be files of the folder")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ConfigError(f"{option}: {folder / INDEX} lists {len(missing)} shard(s) that are not in the folder: "
                              f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        return {name: folder / f for name, f in weight_map.items()}
    present = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as weights:
            present.update(dict.fromkeys(weights.keys(), f))
    if not present:
        raise ConfigError(f"{option}: {folder} has config.json but no .safetensors weights")
    return present


def check(folder: Path, args: ModelArgs, option: str) -> dict[str, Path]:
    """Fail with one line unless `folder` holds the model `args`, every weight of it and no other
    (a weight left unread would be another model's: a config.json that drops a part of it); reads
    the config and the safetensors headers only. Returns the weight files."""
    theirs = hf_model_args(folder, option)
    differ = describe_difference(replace(theirs, mtp_layers=min(theirs.mtp_layers, args.mtp_layers)), args)
    if differ:
        raise ConfigError(f"{option}: {folder} holds another model than this run's ({differ} in this run)")
    present = weight_files(folder, option)
    present |= {ours: present[stored] for ours, stored in stored_names(present, args).items()}
    used = [hf for n in parameter_shapes(args)[0] + buffer_names(args) for hf in hf_names(n, args)]
    missing = [hf for hf in used if hf not in present]
    if missing:
        raise ConfigError(f"{option}: {folder} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    unused = sorted(set(present) - set(used) - set(stored_names(present, args).values())
                    - {name for name in present if no_weight(name, args)})
    if unused:
        raise ConfigError(f"{option}: {folder} holds {len(unused)} tensor(s) that the model of its config.json does "
                          f"not use: {unused[:3]}{' ...' if len(unused) > 3 else ''}")
    return present


def no_weight(name: str, args: ModelArgs) -> bool:
    """A tensor of a folder that is none of its model's weights, which transformers leaves unread
    too: a RoPE table (older folders; plait computes its own), a tied model's stored copy of its
    output layer (tie_word_embeddings: the embedding is the output layer, as transformers ties it),
    and DeepSeek-V3's layers past the model's (an MTP module the run leaves out, the MTP module's
    copies of the embedding and output)."""
    layer = LAYER.match(name.removeprefix("model."))
    return name.endswith(".rotary_emb.inv_freq") or (args.tie_embeddings and name == "lm_head.weight") or (
        args.family == "deepseek_v3" and layer is not None and int(layer.group(1)) >= args.n_layers) or (
        args.family in QWEN_HYBRIDS and name.startswith("mtp.") and not args.mtp_layers)  # (an MTP module the run
    # leaves out, as transformers does)


def parameter_shapes(args: ModelArgs) -> tuple[list[str], dict[str, torch.Size]]:
    """The model's parameters by plait name, each once (a tied output layer is the embedding), and
    the shape of each parameter and buffer."""
    from plait.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return [name for name, _ in model.named_parameters()], \
        {name: t.shape for name, t in [*model.named_parameters(), *model.named_buffers()]}


def buffer_names(args: ModelArgs) -> list[str]:
    """The buffers a family's folder holds (DeepSeek-V3's routers' balancing biases)."""
    if args.family not in ("deepseek_v3", "glm4_moe", "kimi_linear"):
        return []
    return [f"layers.{i}.{ROUTER_BIAS}" for i in range(args.n_layers) if args.sparse(i)] + \
        [f"mtp.{k}.block.{ROUTER_BIAS}" for k in range(args.mtp_layers) if args.sparse(args.n_layers + k)]


class HFWeights(Mapping):
    """A Hugging Face folder's weights as a plait state dict (fp32, plait names and RoPE
    order), checked against `args` up front and read one tensor at a time, memory-mapped, when
    asked for: a rank holds one full tensor at a time while it cuts its shard, never the model."""

    def __init__(self, folder: Path, args: ModelArgs, option: str):
        self.args, self.option, self.files = args, option, check(folder, args, option)
        self.stored = stored_names(self.files, args)  # (plait's name on disk -> the folder's, where they differ)
        self.names, self.shapes = parameter_shapes(args)
        self.buffers = {name: self[name] for name in buffer_names(args)}  # (small: read at once)

    def __getitem__(self, name: str) -> torch.Tensor:
        pieces = []
        for hf in hf_names(name, self.args):
            with safe_open(str(self.files[hf]), "pt") as weights:
                pieces.append(weights.get_tensor(self.stored.get(hf, hf)).float())
        held = held_with_others(name, self.args)
        try:  # (an expert tensor's slices stacked; the parts on disk of one holding several, joined)
            tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if held else torch.stack(pieces)
            if self.args.family in FUSED_EXPERTS and ".experts." in name:
                tensor = fused_expert(name, tensor, self.args.family).contiguous()
            if held is not None:
                tensor = fused_part(tensor, name, *held[1:]).contiguous()
            if disk_shape(self.args, hf_names(name, self.args)[0]) == tuple(tensor.shape):
                tensor = tensor.reshape(self.shapes[name])
            if rope_reordered(name, self.args):
                tensor = from_hf_rope_order(tensor, self.args.head_dim, self.args.rope_dim)
        except RuntimeError:  # (a shape the reordering cannot take: refused below)
            tensor = None
        if tensor is None or tensor.shape != self.shapes[name]:
            raise ConfigError(f"{self.option}: {self.files[hf_names(name, self.args)[0]].parent}'s "
                              f"{hf_names(name, self.args)[0]} has the shape {list(pieces[0].shape)}, not the one "
                              "the model of its config.json has: the config.json describes another model")
        return tensor

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
