"""Every option of a plait job: typed defaults (read from TOML files and the command line by
`plait.arguments`) and the quantities derived from them (world size, dp degree, accumulation).

One dataclass per TOML section. The same names work as `--section.key VALUE` on the command
line and as `[section] key = value` in a TOML file; the command line wins. `plait.checks` checks
the options against each other before any process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from plait.flavor_names import ModelFlavor


class ConfigError(ValueError):
    """A bad option: the message names the option and what is allowed."""


@dataclass
class Model:
    flavor: ModelFlavor = "auto"
    """model size and family: debug (tiny), small (~90M, CPU benchmarks), the real shapes of Llama 3 and its
    relatives, of mixtures of experts (Qwen3-MoE, gpt-oss, DeepSeek-V3, Kimi K2), and debug_* twins with each
    family's switches (docs/families.md); auto: the config.json of a Hugging Face folder given as
    --checkpoint.load, else debug"""
    shrink: bool = False
    """cut the flavor to two blocks of width 64 (its family's structure kept: head grouping, norms, windows,
    fewer experts, latent attention), all other options as given: a recipe's real job tried on a CPU"""
    n_layers: int = 0
    """transformer blocks; 0 = the flavor's (e.g. more blocks for more pipeline stages)"""
    max_seq_len: int = 0
    """the longest sequence the model takes (its RoPE table); 0 = the flavor's (e.g. small at 32768 tokens)"""
    sliding_window: int = 0
    """each query sees itself and the N - 1 keys before it, in every block but model.full_layers; 0 = the
    flavor's (none for most) or the Hugging Face folder's"""
    full_layers: tuple[int, ...] = ()
    """with model.sliding_window: the blocks that attend over the whole sequence (e.g. 1 3 5: local, global, ...)"""
    tie_embeddings: bool = False
    """one matrix for the input embedding and the output layer (as Llama 3.2 1B/3B, SmolLM2)"""
    mtp_layers: int = -1
    """multi-token prediction modules (DeepSeek-V3's; 0 or 1): from the model's normed output and the embedding of
    token t+1 one more block predicts token t+2, its loss weighted by training.mtp_loss_weight; -1 = the
    flavor's (1 for debug_mla and deepseek_v3_671b) or the Hugging Face folder's (when it holds the weights)"""
    attention_mask: Literal["document", "causal"] = "document"
    """document: a token attends only to earlier tokens of its own document (end-of-text tokens separate
    the packed documents) and RoPE positions restart at each; causal: across the whole packed sequence"""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """attention kernel: sdpa (scaled_dot_product_attention, a mask tensor under the document mask), flex
    (FlexAttention with a block mask: skips masked blocks; CUDA only for training); auto: flex for the
    document mask on CUDA without pp, cp or debug.dtype_probe, else sdpa"""


@dataclass
class Training:
    steps: int = 60
    """optimizer steps to run"""
    global_batch_size: int = 16
    """sequences per optimizer step over all data-parallel ranks"""
    micro_batch_size: int = 0
    """sequences per forward per data-parallel rank; 0 = global / dp degree (no accumulation)"""
    seq_len: int = 128
    """tokens per sequence"""
    batch_rampup: tuple[int, int] = (0, 0)
    """START TOKENS: START sequences a step, up to global_batch_size over TOKENS tokens (docs/growth.md); 0 0 = none"""
    seq_len_warmup: tuple[int, int] = (0, 0)
    """START TOKENS: sequences of START tokens, up to seq_len over TOKENS tokens (docs/growth.md); 0 0 = none"""
    phases: tuple[str, ...] = ()
    """from a step or a number of tokens: another mixture, the lr's own decay, shorter sequences, one string each
    ("step=161 mix=hq:1 decay=linear to=0"; TOML: [[phase]] tables; docs/growth.md)"""
    lr: float = 2e-3
    """peak learning rate (AdamW), reached after warmup, then lr_schedule"""
    warmup_steps: int = 10
    """linear warmup steps"""
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """after warmup: cosine decay to min_lr_ratio x lr at the last step; wsd: lr until the last decay_fraction of
    the steps, then decay_shape down to min_lr_ratio x lr; constant: lr"""
    min_lr_ratio: float = 0.1
    """the lr of the last step, as a fraction of lr (cosine, wsd)"""
    decay_fraction: float = 0.2
    """wsd: the share of the steps that decay"""
    decay_shape: Literal["linear", "sqrt", "cosine"] = "linear"
    """wsd: the decay's shape (sqrt: 1 - sqrt of the decay's progress, falling fast at first)"""
    max_norm: float = 1.0
    """gradient clipping by global norm; 0 disables clipping (the norm is still logged)"""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms)"""
    seed: int = 0
    """seed for weight init and data order"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA+NCCL when present, else CPU+gloo"""
    threads: int = 0
    """CPU threads per rank; 0 = cores / local ranks (results depend on it: pin it to compare runs)"""
    loss_chunk: int = 256
    """tokens per chunk of the output layer and loss: never the whole logits (plait/models/loss.py); 0 = whole"""
    z_loss: float = 0.0
    """weight of PaLM's z-loss (mean squared log-sum-exp of the logits; PaLM: 1e-4) added to the gradient; 0 = none"""
    ema: float = 0.0
    """decay of an exponential moving average of the weights, updated each step and saved in each checkpoint (e.g.
    0.999); export, eval, generate and merge read it with --weights ema; 0 = none"""
    spike_policy: Literal["warn", "skip", "rollback"] = "warn"
    """a loss or grad_norm spike: warn = a line and a metrics row; skip = also no update (schedule and data go on);
    rollback = also the last checkpoint's weights and optimizer state back (the data since not seen again)"""
    spike_threshold: float = 6.0
    """a spike: over median + this x 1.4826 x the median deviation of the last 100 unspiked steps (after 20)"""
    offload: Literal["none", "optimizer"] = "none"
    """optimizer = FSDP2's CPU offload: parameters' shards, gradients and optimizer state in host memory, AdamW stepped
    by the host (CUDA, fsdp2, adamw; plait/parallel/data_parallel.py)"""
    host_memory: Literal["auto", "retain", "release"] = "auto"
    """retain: keep freed host memory in the process (glibc: no mmap, no trimming) instead of faulting the same
    activations in again every step; release: glibc's default; auto = retain on a CPU device (plait/host_memory.py)"""
    mixed_precision_param: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """compute dtype of matmuls; auto = bfloat16 where the device has bf16 matmul units (CUDA sm80+, AMX or
    AVX512-BF16 CPUs), float32 where bf16 would be emulated (float16 is refused: it would need loss scaling)"""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """dtype gradients travel and are reduced in"""
    mixed_precision_mode: Literal["param", "autocast"] = "param"
    """param: parameters cast at module boundaries (FSDP2 policy); autocast: op-level torch.autocast in forward"""
    float8: Literal["none", "tensorwise", "rowwise", "mxfp8", "mxfp8_wgrad_hp"] = "none"
    """float8 matmuls in the blocks' linear layers (torchao's recipes, the .[float8] extra: scales per tensor,
    per row, or MXFP8's per 32 elements, also on the experts; mxfp8_wgrad_hp: weight gradients in the compute
    dtype); master weights, attention, norms and the output layer stay as above"""
    moe_aux_loss_coef: float = 0.001
    """mixtures of experts with a softmax router: weight of the load-balancing loss (Switch Transformer's, the
    mean over MoE layers, the MTP block's included) added to the gradient; 0 = none (it is logged either way)"""
    moe_sequence_aux_coef: float = 0.0
    """mixtures of experts with a sigmoid router: weight of DeepSeek-V3's sequence-wise balance loss (the mean over
    MoE layers, the MTP block's included; DeepSeek-V3 trained with 0.0001) added to the gradient, logged as
    aux_loss (1 when balanced); 0 = none: the router bias balances alone"""
    mtp_loss_weight: float = 0.3
    """models with multi-token prediction (model.mtp_layers): the weight of its loss, added to the gradient
    (DeepSeek-V3's 0.3, lowered to 0.1 for its last 4.8T tokens); logged as mtp_loss either way"""
    moe_bias_rate: float = 0.001
    """mixtures of experts with a sigmoid router: after each step every router bias moves by this towards
    balance (up for experts under the mean load, down above it; DeepSeek-V3's auxiliary-loss-free balancing)"""
    eval_interval: int = 0
    """measure the validation loss (data.val_path) every N steps and at the last step; 0 = auto: every
    ceil(steps / 10) steps with a data.val_path (about ten evaluations), never without one"""
    eval_steps: int = 4
    """validation batches of global_batch_size sequences per evaluation: the same sequences every time"""


@dataclass
class Optimizer:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: every parameter; muon: the blocks' matrices (experts' too) orthogonalised by Newton-Schulz, scaled
    to AdamW's RMS so training.lr and weight_decay carry over (Moonlight), the rest AdamW"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates"""
    eps: float = 1e-8
    """AdamW's denominator term"""
    momentum: float = 0.95
    """muon: momentum (Nesterov) of its matrices"""
    ns_steps: int = 5
    """muon: Newton-Schulz iterations per matrix and step"""


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """data-parallel replicas (DDP); with dp_shard > 1 this is HSDP"""
    dp_shard: int = -1
    """FSDP2 shard degree; -1 = whatever the world size leaves"""
    tp: int = 1
    """tensor-parallel degree"""
    ep: int = 1
    """expert-parallel degree (mixtures of experts): each MoE layer's experts split over ep ranks borrowed from
    the data-parallel ranks (dp_shard x cp), tokens sent to their experts' ranks and back by all-to-all; FSDP2
    shards expert parameters over the dp_shard x cp ranks ep leaves, the rest over all of them"""
    pp: int = 1
    """pipeline-parallel degree (the outermost mesh dimension)"""
    cp: int = 1
    """context-parallel degree: each sequence split over cp ranks (load-balanced chunks); mesh order pp,
    dp_replicate, dp_shard, cp, tp"""
    cp_kind: Literal["allgather", "ulysses", "hybrid"] = "allgather"
    """with cp > 1, how attention meets the whole sequence: allgather = every layer all-gathers the sequence's
    keys and values; ulysses = all-to-alls turn sequence shards into head shards of the whole sequence and back
    (cp must divide the query heads per tp rank; key/value heads are repeated up to a multiple of cp); hybrid =
    Ulysses over groups of cp_ulysses neighbouring ranks, then all-gather over the groups (cp > the heads)"""
    cp_ulysses: int = 0
    """with cp_kind hybrid: the Ulysses degree inside cp (a divisor of cp between 1 and cp)"""
    cp_gather: Literal["latent", "expanded"] = "latent"
    """with cp_kind allgather, latent attention (MLA): latent = gather each token's key latent and RoPE key
    (kv_lora_rank + qk_rope_head_dim values) and expand them on every rank (deepseek_v3_671b: 71x fewer bytes,
    for cp x wkv_b's FLOPs); expanded = gather every head's keys and values, as other attention does"""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = "1f1b"
    """with pp > 1: torch.distributed.pipelining schedule; interleaved_* and zbv run several stages per rank"""
    pp_microbatches: int = 0
    """with pp > 1: pipeline micro-batches per step, which split the local batch; 0 = the number of stages"""
    pp_stages_per_rank: int = 0
    """with pp > 1: stages per rank; 0 = 1 for gpipe/1f1b, 2 for interleaved_*/zbv (zbv needs exactly 2)"""
    pp_split_points: tuple[int, ...] = ()
    """with pp > 1: the first block of every stage but the first (stages - 1 increasing block indices);
    empty = balanced, the embedding and the output layer counting as one block each"""
    sequence_parallel: bool = True
    """with tp > 1: split norms and the residual stream along the sequence between TP regions"""
    loss_parallel: bool = True
    """with tp > 1 and training.loss_chunk 0: cross-entropy on vocabulary-sharded logits (the chunked loss always is)"""
    dp_backend: Literal["fsdp2", "ddp", "simple_fsdp"] = "fsdp2"
    """fsdp2: fully_shard on the (dp_replicate, dp_shard) mesh for every dp layout; ddp: classic DistributedDataParallel; simple_fsdp: DTensor parametrization"""
    reshard_after_forward: bool = True
    """simple_fsdp with dp_shard > 1: free gathered parameters after forward, re-gather in backward"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """none: keep every block's activations; full: keep each block's input, recompute the block in backward; selective: keep matmul, attention and TP-reduction outputs, recompute the rest"""
    every: int = 1
    """with full/selective: checkpoint blocks 0, N, 2N, ... only (1 = every block)"""


@dataclass
class Data:
    path: str = ""
    """a folder made by `plait tokenize`, or raw text: a .txt/.md/.jsonl(.gz/.zst)/.parquet file, a folder of them,
    or a Hugging Face `datasets` folder (tokenized into the cache at first use); empty = bundled corpus"""
    mix: str = ""
    """instead of data.path, several sources with weights: "PATH:WEIGHT,PATH:WEIGHT" (e.g. "web:0.7,code:0.3");
    each sequence of a step draws its source from the weights, seeded by (training.seed, step)"""
    val_path: str = ""
    """validation data (a tokenized folder or raw text, the training tokenizer's), for training.eval_interval"""
    tokenizer: str = ""
    """a tokenizer.json (e.g. Llama 3's); empty = a BPE trained once on the corpus and cached"""
    vocab_size: int = 4096
    """vocabulary of the trained BPE (ignored when data.tokenizer is given)"""
    text_field: str = "text"
    """column or JSON key that holds the text in .jsonl/.parquet/datasets inputs"""
    extensions: tuple[str, ...] = ()
    """more file extensions read as plain text, one document per file, besides .txt and .md (e.g. .rst .tex)"""


@dataclass
class Eval:
    tasks: tuple[str, ...] = ("sample",)
    """multiple-choice tasks scored every eval.interval steps: a .jsonl file of {"context": str, "choices": [str, ...],
    "gold": index} per line (lm-evaluation-harness's multiple_choice format), or a bundled task's name (sample: word
    order in the bundled corpus's Python docs)"""
    loss_sets: str = ""
    """named validation sets whose loss is measured every eval.interval steps, "NAME:PATH,NAME:PATH" (e.g.
    "web:web_val.jsonl,code:code_tokens/"), each raw text or a tokenized folder; metrics val_loss_NAME"""
    interval: int = 0
    """score eval.tasks and eval.loss_sets every N steps and at the last step; 0 = never"""
    limit: int = 0
    """score the first N examples of each task; 0 = all"""
    num_fewshot: int = 0
    """examples with their answers before each question: the task's first N others (lm-evaluation-harness's
    first_n sampler over the task's own examples)"""
    target_delimiter: str = " "
    """between a question and its answer (lm-evaluation-harness's default)"""
    fewshot_delimiter: str = "\n\n"
    """after each few-shot example (lm-evaluation-harness's default)"""


@dataclass
class Metrics:
    jsonl: str = ""
    """rank 0 writes one JSON object per optimizer step to this file (a resumed run keeps the rows up to its
    checkpoint and replaces the rest; a new run starts the file afresh)"""
    tensorboard: str = ""
    """write TensorBoard event files to this folder (a resumed run drops the events after its checkpoint from the
    files, a new run all of them, so each step is there once)"""
    log_interval: int = 5
    """print a console line every N steps (and the first, the last, and every evaluation), with the mean tokens/s
    and MFU since the line before and an ETA; the run ends with a summary (metrics.jsonl's <name>.summary.json)"""
    plot: str = ""
    """when the run ends (also by a signal or an error), draw metrics.jsonl's loss, val_loss, lr, grad_norm and
    tokens/s to this PNG, as `plait plot` does"""
    wandb_project: str = ""
    """log to this Weights & Biases project (pip install -e ".[wandb]"): the config, every step's metrics, the
    end-of-run summary; a run resumed from checkpoint.folder continues its W&B run (id kept in that folder)"""
    wandb_run_name: str = ""
    """the W&B run's display name; empty = W&B's own"""
    wandb_offline: bool = False
    """write the W&B run to a local folder only (upload it later with `wandb sync`); without it, W&B's own
    setting decides (WANDB_MODE, `wandb offline`)"""


@dataclass
class Comm:
    timeout_seconds: int = 300
    """collective timeout: a rank that stops answering makes the others fail after this"""


@dataclass
class FaultTolerance:
    enable: bool = False
    """train as one of `groups` replica groups under torchft (pip install 'plait[ft]'): the groups average
    gradients every step; a group that dies is left out until it comes back and heals from a live one"""
    groups: int = 2
    """replica groups (each its own torchrun job with this layout inside); the global batch is split over them"""
    replica_id: int = 0
    """this group's index in [0, groups); `plait train --nproc N` with fault_tolerance.enable starts them all"""
    min_replicas: int = 1
    """a step commits only where at least this many groups take part in it (a group's first step waits for
    every group, up to quorum_timeout_seconds, so a job that starts or restarts starts together)"""
    lighthouse: str = ""
    """torchft lighthouse (http://HOST:PORT) the groups meet at; empty = $TORCHFT_LIGHTHOUSE"""
    quorum_timeout_seconds: int = 60
    """how long a step waits for the groups to agree who takes part (a group's first step: for every group)"""


@dataclass
class Checkpoint:
    folder: str = ""
    """save training checkpoints here (step-N folders; a path or s3://bucket/run) and resume from the newest one"""
    interval: int = 0
    """save every N steps and at the last step; 0 = at the last step only (a signal that stops the run saves its
    step either way)"""
    keep_latest_k: int = 0
    """keep only the newest K complete checkpoints; 0 = keep all"""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: stage the state in memory and write it while training goes on"""
    load: str = ""
    """initial weights when checkpoint.folder has nothing to resume: a seed or training checkpoint, or a Hugging Face Llama folder"""
    on_error: Literal["stop", "continue"] = "stop"
    """a save that fails (a full disk, a server down): stop the run, or say so and train on (the next save tries again)"""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile (inductor): each transformer block, or with dp_backend simple_fsdp the whole model"""
    bucketing: Literal["block", "none"] = "block"
    """simple_fsdp compiled: block = a block's per-parameter all-gathers (and reduce-scatters) merged into one"""
    autograd: bool = False
    """compiled autograd for backward (dp_backend ddp only: it silently breaks FSDP2)"""
    report: str = ""
    """write what the compiler did (graph breaks and their reasons, recompiles after step 2) to this JSON, per rank"""


@dataclass
class Debug:
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) and deterministic cuDNN/cuBLAS settings"""
    dtype_probe: str = ""
    """write the dtypes of step 1's matmuls and collectives, by phase, to this JSON file"""


@dataclass
class Profiling:
    enable: bool = False
    """record a torch.profiler trace (shapes and dtypes included) of profiling.steps steps on every rank"""
    steps: int = 2
    """steps to profile, starting after the first step (whose lazy initialisation would swamp the trace)"""
    start_step: int = 0
    """first step to profile; 0 = the step after the first (`plait bench` profiles one after those it measures)"""
    folder: str = "profiles"
    """write one Chrome trace per rank here (rank{R}.json): open in Perfetto, summarise with `plait trace`"""


@dataclass
class JobConfig:
    config: str = ""
    """a named config (`plait recipes` lists them) or a TOML file; its values are the defaults, flags win"""
    nproc: int = 1
    """local convenience: launch this many processes through torchrun"""
    max_restarts: int = 0
    """with nproc: bring the job back up to this many times after a process dies (torchrun --max-restarts); it
    resumes from the newest complete checkpoint"""
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)
    profiling: Profiling = field(default_factory=Profiling)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


CHECKPOINT_MANIFEST = "plait.json"  # written last: a folder that has it is a complete plait checkpoint


def replica_groups(cfg: JobConfig) -> int:
    """Replica groups the global batch is split over: fault_tolerance.groups, or 1."""
    return cfg.fault_tolerance.groups if cfg.fault_tolerance.enable else 1


def dp_degree(cfg: JobConfig) -> int:
    """Ranks that read different batches, in every replica group together."""
    return cfg.parallelism.dp_replicate * cfg.parallelism.dp_shard * replica_groups(cfg)


def grad_accumulation_steps(cfg: JobConfig) -> int:
    return cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp_degree(cfg))
