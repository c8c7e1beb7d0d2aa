"""The cluster model's second development set: published multi-GPU runs on H100 with today's recipes, as data.

Six public tables, transcribed with their sources (each table's `source`); benchmarks/cluster_model.py plans
every dense row (bf16 and FP8, context parallelism included) and prints the MoE rows as data with the reason
they wait (expert parallelism with forced balance). Where a table does not publish an input, its `assumption`
says what was taken, once for the whole table: nothing here is set per row, and nothing is fitted.

FLOP conventions differ between sources, so only step times (or tokens/s) are compared, never MFUs:
  - Megatron-LM / NeMo "model TFLOP/s/GPU" (Megatron-LM megatron/training/training.py
    num_floating_point_operations; NeMo's GPT-3 formula, e.g. 175B: 2048 x [(24 L h^2 + 12 L h s) + 48 L h^2
    + 6 V h] = 2.20e15 per sample): per sample s x (72 L h^2 + 12 L h s + 6 V h) for a GPT with FFN 4h
    and as many key-value heads as heads (`megatron_flops_per_sample`).
  - NeMo's per-family formulas (nemo/utils/flops_formulas.py, `nemo_flops_per_token`), tables B and B2.
  - torchtitan: TPS = tokens per second per GPU.
  - llm-foundry: tokens/s/GPU (its MFU counts 6N + attention, not compared).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.config import ModelConfig
from trainwise.presets import get_preset

GB = 1e9


@dataclass(frozen=True)
class Table:
    key: str
    title: str
    source: str  # the public document the rows come from
    assumption: str = ""  # what the table does not publish and was assumed, for all of its rows


# ---------------------------------------------------------------------------------------------------
# A. Megatron-Core r0.8.0 on H100 (DGX H100), weak scaling, bf16

MEGATRON_R08 = Table(
    "A", "Megatron-Core r0.8.0 on H100, weak scaling",
    "NVIDIA/Megatron-LM README (Megatron-Core r0.8.0, 2024-07), images/model_table.png",
    "bf16 with Megatron's mixed precision (bf16 weights and activations, "
    "fp32 main gradients, master weights and Adam moments: the planner's `megatron` recipe, 18 bytes/param; "
    "`bf16-mixed` keeps 16-bit gradients, which Megatron-Core does not do in bf16; the planner reduces the "
    "`megatron` recipe's gradients in 16 bits as Megatron-LM's fp16 runs did, where bf16 Megatron-Core reduces "
    "fp32 ones); no activation recompute "
    "(Megatron's default without --recompute-*); micro-batch 1; no virtual stages (vpp 1); "
    "attention at FlashAttention-2's rates (Transformer Engine ran cuDNN's FusedAttention there; planned "
    "with cuDNN's rates these rows read too fast, long sequences most: RESULTS.md, tables A, B and B2 under "
    "cuDNN); "
    "sequence parallelism (--tp-comm-overlap needs it) with --tp-overlap te (every pass's tp collectives under "
    "the GEMMs); gradient reduce-scatter overlapped "
    "(--overlap-grad-reduce) and ZeRO-1 (the distributed optimizer, which --overlap-param-gather implies); "
    "a GPT with Megatron-LM's defaults (learned positions, LayerNorm, GELU, FFN 4h, biases, dropout 0.1) but "
    "untied embeddings (the names' sizes are 12 L h^2 + 2 V h: 7.1B = 6.04B + 2 x 0.54B); vocabulary 131,072, "
    "sequence 4,096; DGX H100 nodes")
A_VOCAB, A_SEQ = 131072, 4096


@dataclass(frozen=True)
class MegatronRow:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float  # published model TFLOP/s per GPU (Megatron-LM's FLOP count)
    mfu: float  # published, against 989 TFLOP/s


TABLE_A = [
    MegatronRow("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    MegatronRow("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    MegatronRow("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    MegatronRow("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    MegatronRow("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    MegatronRow("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    MegatronRow("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    MegatronRow("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    MegatronRow("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]


def megatron_flops_per_sample(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Megatron-LM's model FLOPs of one sample (fwd + bwd, no recompute) for a GPT with FFN 4h and MHA:
    s x 12 L h^2 (2 + s/h + 4 + V / (2 L h)) = s x (72 L h^2 + 12 L h s + 6 V h) (module docstring)."""
    return seq * (72 * layers * hidden**2 + 12 * layers * hidden * seq + 6 * vocab * hidden)


def published_step_a(row: MegatronRow) -> float:
    """Seconds per step implied by the published TFLOP/s/GPU under the table's own FLOP count."""
    flops = row.global_batch * megatron_flops_per_sample(row.layers, row.hidden, A_SEQ, A_VOCAB)
    return flops / (row.gpus * row.tflops_per_gpu * 1e12)


def megatron_gpt(row: MegatronRow) -> ModelConfig:
    return ModelConfig(name=f"Megatron {row.name}", vocab_size=A_VOCAB, d_model=row.hidden, n_layers=row.layers,
                       n_heads=row.heads, n_kv_heads=row.heads, ffn_hidden=4 * row.hidden, activation="gelu",
                       norm="layernorm", position="learned", bias=True, dropout=0.1, max_seq_len=A_SEQ,
                       tie_embeddings=False)


# ---------------------------------------------------------------------------------------------------
# B. NeMo 24.07 on DGX H100, FP8

NEMO_2407 = Table(
    "B", "NeMo 24.07 performance summary, DGX H100, FP8",
    "NVIDIA/NeMo docs/source/performance/performance_summary.md (24.07); model shapes: NeMo's "
    "nemo/collections/llm/gpt/model/base.py (GPTConfig5B/20B/175B) and nemotron.py (Nemotron3Config8B/22B, "
    "Nemotron4Config340B), the Llama models' config.json on the Hugging Face hub",
    "FP8 as NeMo 24.07 ran it by default: Transformer Engine's delayed scaling (fp8_hybrid, amax history 1024 in "
    "NVIDIA/NeMo-Framework-Launcher's gpt3 *_fp8_performance.yaml; the planner's `fp8-delayed` recipe) over "
    "Megatron's mixed precision (bf16 weights and activations, fp32 main gradients, master weights and Adam "
    "moments); no activation recompute (the page states none); "
    "attention at FlashAttention-2's rates (Transformer Engine ran cuDNN's FusedAttention there; planned "
    "with cuDNN's rates these rows read too fast, long sequences most: RESULTS.md, tables A, B and B2 under "
    "cuDNN); "
    "sequence parallelism and tp communication overlapped (--tp-overlap te) with tp > 1 (NeMo's performance "
    "configs); the "
    "distributed optimizer (ZeRO-1) with gradient reduce-scatter and parameter all-gather overlapped; VP virtual "
    "stages as given, their pipeline sends under the neighbouring chunks' work (--pp-overlap: Megatron-Core's "
    "overlap_p2p_comm, with batch_p2p_comm off, in NVIDIA/NeMo-Framework-Launcher's llama2_70b.yaml, the Llama 2 "
    "70B row's TP 4 PP 4 VP 20; Megatron-LM's default with virtual stages); micro-batches per step = "
    "GBS / (MBS x DP), DP = GPUs / (TP x PP x CP); published s = "
    "GBS x seq / (GPUs x tokens/s/GPU). Shapes: GPT3 as NeMo's GPT-3 configs (5B: 24 layers, hidden 4096, 32 "
    "heads; 20B: 44, 6144, 48; 175B: 96, 12288, 96; FFN 4h, learned positions, LayerNorm, GELU, biases, tied "
    "embeddings, dropout 0.1; the GPT-2 BPE's 50,257 tokens padded to 50,304); Llama 2 13B (40, 5120, 40 heads, "
    "FFN 13824) and 70B (80, 8192, 64 heads / 8 KV, FFN 28672) and the presets llama-2-7b, llama-3-8b, "
    "llama-3-70b; Nemotron 8B (32, 4096, 32 heads, FFN 16384), 22B (40, 6144, 48, FFN 24576), 340B (96, "
    "18432, 96 heads / 8 KV, FFN 73728): LayerNorm, RoPE, no biases, untied, vocabulary 256,000, squared ReLU "
    "planned as GELU (the same two GEMMs and one element-wise op that saves its input and output); DGX H100 "
    "nodes")
GPT3_VOCAB, NEMOTRON_VOCAB = 50304, 256000
# NeMo's FLOP formulas count GPT-3's vocabulary as 51,200 (nemo/utils/flops_formulas.py, LLM_VOCAB_SIZE_MAP)
NEMO_FORMULA_VOCAB = {"GPT3": 51200}


@dataclass(frozen=True)
class NemoRow:
    model: str
    gpus: int
    global_batch: int
    micro_batch: int
    seq: int
    tp: int
    pp: int
    cp: int
    vp: int
    tokens_per_s_gpu: float
    tflops_per_gpu: float  # published model TFLOP/s per GPU (nemo_flops_per_token)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


TABLE_B = [
    NemoRow("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 22521, 736),
    NemoRow("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851, 750),
    NemoRow("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 726, 782),
    NemoRow("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 782, 842),
    NemoRow("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16847, 776),
    NemoRow("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8646, 754),
    NemoRow("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1707, 759),
    NemoRow("Nemotron-8B", 64, 256, 4, 4096, 2, 1, 1, 1, 12701, 653),
    NemoRow("Nemotron-22B", 64, 256, 2, 4096, 2, 4, 1, 10, 4256, 554),
    NemoRow("Nemotron-340B", 128, 32, 1, 4096, 8, 8, 1, 12, 322, 678),
    NemoRow("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12036, 697),
    NemoRow("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1533, 738),
]
NEMO_PRESETS = {"LLAMA2-7B": "llama-2-7b", "LLAMA3-8B": "llama-3-8b", "LLAMA3-70B": "llama-3-70b"}
NEMO_SHAPES = {  # layers, hidden, heads, key-value heads, FFN (the table's assumption)
    "GPT3-5B": (24, 4096, 32, 32, 16384), "GPT3-20B": (44, 6144, 48, 48, 24576),
    "GPT3-175B": (96, 12288, 96, 96, 49152), "LLAMA2-13B": (40, 5120, 40, 40, 13824),
    "LLAMA2-70B": (80, 8192, 64, 8, 28672), "Nemotron-8B": (32, 4096, 32, 32, 16384),
    "Nemotron-22B": (40, 6144, 48, 48, 24576), "Nemotron-340B": (96, 18432, 96, 8, 73728),
}


def nemo_model(name: str, seq: int) -> ModelConfig:
    """A table B model (the table's assumption) for sequences of `seq` tokens."""
    if name in NEMO_PRESETS:
        return replace(get_preset(NEMO_PRESETS[name]), name=name, max_seq_len=seq)
    layers, hidden, heads, kv, ffn = NEMO_SHAPES[name]
    shape = dict(name=name, d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=hidden // heads,
                 ffn_hidden=ffn, max_seq_len=seq)
    if name.startswith("LLAMA2"):
        return replace(get_preset("llama-2-7b"), **shape)
    if name.startswith("GPT3"):
        return ModelConfig(vocab_size=GPT3_VOCAB, activation="gelu", norm="layernorm", position="learned", bias=True,
                           dropout=0.1, tie_embeddings=True, **shape)
    return ModelConfig(vocab_size=NEMOTRON_VOCAB, activation="gelu", norm="layernorm", position="rope", bias=False,
                       dropout=0.0, tie_embeddings=False, **shape)


def nemo_flops_per_token(cfg: ModelConfig, seq: int, vocab: int | None = None) -> float:
    """NeMo's model FLOPs per token, forward and backward (nemo/utils/flops_formulas.py: gpt3, llama2, llama3,
    nemotron): 12 L h^2 (1 + kv/heads + s/h) + c L F h + 6 V h, c = 18 for a gated MLP (three matrices) and 12
    for two; GPT-3's (72 L h^2 + 12 L h s + 6 V h) is the same with F = 4h and kv = heads. `vocab`: the formula's
    own where it differs from the model's (NEMO_FORMULA_VOCAB)."""
    layers, h = cfg.n_layers, cfg.d_model
    mlp = (18 if cfg.gated else 12) * layers * cfg.ffn_hidden * h
    attention = 12 * layers * h * h * (1 + cfg.n_kv_heads / cfg.n_heads + seq / h)
    return attention + mlp + 6 * (vocab or cfg.vocab_size) * h


def published_step_from_tokens(row: NemoRow | BridgeRow) -> float:
    """Seconds per step implied by the published tokens/s per GPU (tables B and C): GBS x seq / (GPUs x
    tokens/s/GPU)."""
    return row.global_batch * row.seq / (row.gpus * row.tokens_per_s_gpu)


NEMO_LONG = Table(
    "B2", "NeMo 24.03.01 long sequences, Llama2-7B FP8, DGX H100",
    "NVIDIA/NeMo docs/source/performance/performance_long_sequence.md (its revision of 9421f21, which adds a Batch "
    "Size column to the same NeMo 24.03.01 table)",
    "table B's (Transformer Engine delayed scaling: `fp8-delayed`; no recompute; FlashAttention-2's rates; sequence "
    "parallelism and tp overlap with tp > 1; the distributed optimizer) for the with-CP layouts (TP, PP, DP, "
    "CP as published; the without-CP runs are the best of unpublished layouts, not planned); ring attention "
    "over CP; the global batch as published (4M tokens a step at every length), micro-batch 1 (not published), "
    "so GBS / DP micro-batches per data-parallel replica. Only TFLOP/s/GPU is published: published s = GBS x "
    "NeMo's llama2 FLOPs per sample (nemo_flops_per_token x seq) / (GPUs x TFLOP/s/GPU), so the step-time error "
    "is the inverse of the TFLOP/s one; the batch enters it only through the pipeline bubble (8K: PP 2) and the "
    "once-a-step work (the exposed data-parallel communication, the optimizer)")


@dataclass(frozen=True)
class LongSeqRow:
    seq: int
    gpus: int
    tflops_without_cp: float
    tflops_with_cp: float
    tp: int  # the layout with context parallelism
    pp: int
    dp: int
    cp: int
    global_batch: int  # sequences per step


K = 1024
TABLE_B_LONG = [
    LongSeqRow(4 * K, 4, 768, 768, 1, 1, 4, 1, 1024), LongSeqRow(8 * K, 8, 730, 730, 1, 2, 4, 1, 512),
    LongSeqRow(16 * K, 16, 660, 660, 2, 1, 8, 1, 256), LongSeqRow(32 * K, 32, 595, 610, 2, 1, 8, 2, 128),
    LongSeqRow(64 * K, 64, 534, 574, 4, 1, 8, 2, 64), LongSeqRow(128 * K, 128, 424, 555, 4, 1, 8, 4, 32),
    LongSeqRow(256 * K, 256, 392, 549, 4, 1, 8, 8, 16), LongSeqRow(512 * K, 512, 104, 549, 8, 1, 4, 16, 8),
    LongSeqRow(1024 * K, 1024, 26.5, 536, 8, 1, 4, 32, 4),
]


def published_step_b2(row: LongSeqRow) -> float:
    """Seconds per step implied by the published with-CP TFLOP/s/GPU under NeMo's llama2 formula."""
    flops = row.global_batch * row.seq * nemo_flops_per_token(nemo_model("LLAMA2-7B", row.seq), row.seq)
    return flops / (row.gpus * row.tflops_with_cp * 1e12)


# ---------------------------------------------------------------------------------------------------
# C. Megatron-Bridge on DGX H100, NeMo 25.11 container (the MoE rows wait for expert parallelism)

BRIDGE_2511 = Table(
    "C", "Megatron-Bridge performance summary, NeMo 25.11, DGX H100",
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (NeMo 25.11 container); model shapes: "
    "the models' config.json on the Hugging Face hub",
    "FP8-CS = Transformer Engine's per-tensor current scaling (Float8CurrentScaling: the planner's `fp8` "
    "recipe) over Megatron's mixed precision (bf16 activations, fp32 master weights and Adam moments) with the "
    "FP8 linear weights kept as FP8 parameters and gathered in FP8 (--fp8-params: the performance scripts' "
    "get_precision_config('fp8_cs') is bf16_with_fp8_current_scaling_mixed(), which sets fp8_param_gather = True, "
    "in scripts/performance/utils/helpers.py and src/megatron/bridge/training/mixed_precision.py at 44dae92b0) and "
    "bf16 main gradients, accumulated and reduced in bf16 (--grad-dtype bf16: every family's performance "
    "recipe sets grad_reduce_in_fp32 = False, set_llama3_common_configs, set_llama31_common_configs, "
    "set_gpt_oss_common_configs and set_qwen3_common_configs in scripts/performance/configs at 44dae92b0, the "
    "r0.2.0 branch's commit that published the 25.11 table); the cross-entropy Transformer Engine's fused kernel, "
    "its gradient written over the logits in forward (--loss-kernel te: GPTModelProvider, every row's "
    "model's provider, sets cross_entropy_loss_fusion = True and the performance scripts' "
    "set_common_perf_overrides cross_entropy_fusion_impl = 'te' at 44dae92b0; Megatron-Core then calls TE's "
    "parallel_cross_entropy, whose forward stores the gradient in its input); no activation recompute (none "
    "published; the "
    "recipes at that commit recompute in two rows whose layout is not the table's: Llama 3 8B's H100 recipe "
    "5 layers under DDP where the table publishes FSDP, gpt-oss's its norms and MoE activations at micro-batch "
    "1 where the table publishes 4); cuDNN's fused attention (--attention-impl cudnn: "
    "Transformer Engine's DotProductAttention prefers FusedAttention over FlashAttention on Hopper for 16-bit "
    "inputs since TE 1.2, DotProductAttention.forward, now get_attention_backend, in transformer_engine/pytorch; "
    "with attention sinks, as "
    "gpt-oss has, TE 2.8+ disables FlashAttention and keeps FusedAttention); sequence parallelism and tp "
    "communication overlapped (--tp-overlap te) with tp > 1 but on Qwen3-235B-A22B, whose H100 recipe turns the "
    "overlap off (CommOverlapConfig(tp_comm_overlap=False) in qwen3_235b_a22b_h100_config at that commit); the "
    "distributed optimizer (ZeRO-1) with gradient "
    "reduce-scatter and "
    "parameter all-gather overlapped; FSDP 1 = Megatron FSDP: ZeRO-3 over DP, gathered into and reduced from "
    "its buffers in place (no FSDP2 copies: fsdp_copies off); VP as given (n/a: 1), the pipeline "
    "sends then under the neighbouring chunks' work (--pp-overlap: Bridge's communication-overlap config sets "
    "overlap_p2p_comm with VP > 1); ring "
    "attention over CP; GA = GBS / (MBS x DP) (the published GA column on every row but GPT OSS 120B's, whose 2 "
    "would not make its global batch of 512 from 16 data-parallel ranks of micro-batch 4: 8); published s = GBS x "
    "seq / (GPUs x tokens/s/GPU); "
    "Llama 3 8B / 70B and Llama 3.1 405B = the planner's presets (the same shapes); DGX H100 nodes. MoE rows: the "
    "presets gpt-oss-120b, qwen3-30b-a3b and qwen3-235b-a22b (their config.json), routing force-balanced as the "
    "page states (--moe-imbalance 1), experts folded over TP x DP as Megatron-Core places them with expert tensor "
    "parallelism 1 (--etp 1: the page gives none, and Qwen3-235B's EP 32 exceeds its DP 16), BF16 = Megatron's bf16 "
    "mixed precision with bf16 gradients (`bf16-mixed`: the grouped expert GEMMs in bf16); element-wise work fused "
    "on every row, BF16 too (Transformer Engine's kernels: --fused); the EP all-to-alls under another micro-batch's "
    "work where Bridge's H100 preset sets moe_a2a_overlap (Qwen3-235B-A22B: True in "
    "scripts/performance/configs/qwen3/workload_base_configs.py at that commit, and NVIDIA's Megatron-MoE-ModelZoo "
    "runs the same layout with A2A_OVERLAP=1; gpt-oss: not set, so off; Qwen3-30B-A3B: off, the table's layout, VP "
    "24 and MBS 2, being the 25.09 recipe's, perf_matrix h100 of scripts/performance/configs/qwen3/"
    "qwen3_30b_a3b_llm_pretrain.yaml, which has no such overlap, where the 25.11 branch's recipe sets it with VP 12 "
    "and MBS 1, a layout the table does not publish): --ep-overlap")
BRIDGE_PRESETS = {"LLAMA3_8B": "llama-3-8b", "LLAMA3_70B": "llama-3-70b", "LLAMA3.1_405B": "llama-3.1-405b",
                  "GPT OSS 120B": "gpt-oss-120b", "Qwen3_30B_a3B": "qwen3-30b-a3b",
                  "Qwen3_235B_a22B": "qwen3-235b-a22b"}


@dataclass(frozen=True)
class BridgeRow:
    model: str
    gpus: int
    precision: str  # "fp8-cs" (current scaling) or "bf16"
    global_batch: int
    micro_batch: int
    seq: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    vp: int | None
    ep: int
    grad_accum: int
    tokens_per_s_gpu: float
    tflops_per_gpu: float
    moe: bool = False
    a2a_overlap: bool = False  # Bridge's moe_a2a_overlap for the row (the table's assumption)
    tp_comm_overlap: bool = True  # Bridge's CommOverlapConfig.tp_comm_overlap for the row, with tp > 1


TABLE_C = [
    BridgeRow("LLAMA3_8B", 8, "fp8-cs", 128, 1, 8192, 1, 1, 1, 1, None, 1, 16, 14451, 744),
    BridgeRow("LLAMA3_70B", 64, "fp8-cs", 128, 1, 8192, 0, 4, 8, 1, 5, 1, 64, 1602, 719),
    BridgeRow("LLAMA3.1_405B", 1024, "fp8-cs", 512, 1, 8192, 0, 8, 8, 2, 8, 1, 64, 292, 737),
    BridgeRow("GPT OSS 120B", 64, "bf16", 512, 4, 4096, 0, 1, 4, 1, 1, 8, 2, 5630, 153, moe=True),
    BridgeRow("Qwen3_30B_a3B", 16, "fp8-cs", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 32, 5275, 121, moe=True),
    BridgeRow("Qwen3_235B_a22B", 256, "fp8-cs", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 128, 1575, 233, moe=True,
              a2a_overlap=True, tp_comm_overlap=False),
]


def bridge_accumulation(row: BridgeRow) -> int:
    """Micro-batches per step: GBS / (MBS x DP), DP = GPUs / (TP x PP x CP) (the table's assumption)."""
    return row.global_batch // (row.micro_batch * row.gpus // (row.tp * row.pp * row.cp))


def bridge_model(row: BridgeRow) -> ModelConfig:
    return replace(get_preset(BRIDGE_PRESETS[row.model]), name=row.model, max_seq_len=row.seq)


# ---------------------------------------------------------------------------------------------------
# D. torchtitan on H100 (Grand Teton), Llama 3.1, seq 8192

TORCHTITAN_2412 = Table(
    "D", "torchtitan on H100 (Grand Teton), Llama 3.1",
    "pytorch/torchtitan docs/performance.md at bf835b59 (Dec 2024; later benchmarks/llama3_h100_202412_torchtitan.md)",
    "Grand Teton's H100 (96 GB HBM2e at 2.4 TB/s, the default 500 W power limit where the SXM's TDP is 700 W) "
    "is not in the planner's table: h100-sxm with 96 GB, 2.4 TB/s and its tensor-core kernels (MAMF, FP8, "
    "attention) at 0.922 of the SXM's rates (--clock-share): the page says its peak is 'between SXM "
    "and NVL' and does not know it; the middle of that bracket (H100 NVL datasheet: 835 TFLOP/s bf16 dense, "
    "0.844 of the SXM's 989; FP8 1,671 of 1,979, the same share). Llama 3.1 = the planner's "
    "llama-3-8b, llama-3-70b and llama-3.1-405b presets (the same shapes). FSDP2 = ZeRO-3 over dp, each "
    "gather copied out and each reduce-scatter's input copied in on the compute stream (with PP, "
    "torchtitan's apply_fsdp does not reshard after forward, to avoid per-micro-batch all-gathers, and torch's "
    "pipeline stages keep the blocks gathered through the step's backwards: parameters gathered once per step "
    "and kept, the planner's zero 2 in FSDP2's layout) with its mixed precision (bf16 compute, fp32 sharded "
    "parameters gathered in bf16, fp32 reduce and AdamW states: the planner's `amp` "
    "recipe); Float8 = torchao's float8 with tensorwise (per-tensor current) scaling: the planner's `fp8` "
    "recipe, whose states are Megatron's (bf16 weights, fp32 gradients, master and moments: 18 bytes per "
    "parameter where FSDP2 keeps 16); torch.compile = a compiled run (its element-wise work fused: the cluster "
    "step's fused bytes); "
    "torchtitan's selective AC (its op-level policy: every other matmul's output and attention's kept) planned as "
    "the planner's `op`, the same policy; TP with sequence parallelism, "
    "AsyncTP = --tp-overlap async (the forward's tp collectives under its work, the backward's exposed: "
    "cost.layout.TP_OVERLAPS); without PP the local batch is one micro-batch; with PP torchtitan's "
    "defaults at the commit the page names (9dec370, Dec 2024): 2 stages per rank for interleaved 1F1B (vpp "
    "2) and as many micro-batches as pipeline ranks, 8 of 4 sequences for either schedule (its "
    "build_pipeline_schedule took pipeline_parallel_degree; one per stage, as its help text said, came in Jan "
    "2025); CP = keys and values all-gathered "
    "(torchtitan's context_parallel_rotate_method default, allgather: --cp-impl allgather); "
    "flash attention (SDPA); the loss F.cross_entropy on an fp32 copy of the logits, not compiled (train.py's "
    "loss_fn at 9dec370: --loss-kernel torch); published s = global batch x seq / (GPUs x TPS) (torchtitan's TPS "
    "divides a "
    "data-parallel rank's tokens by tp x pp x cp); 8 GPUs per node over NVLink, 400 Gb/s per GPU between "
    "nodes (DGX H100's node)")
D_SEQ, D_MEMORY, D_BANDWIDTH = 8192, 96 * GB, 2.4e12
# The table's H100 under its 500 W limit: the middle of the page's bracket, between the SXM (1) and the NVL
# (835 / 989 TFLOP/s bf16 dense, NVIDIA's H100 datasheet): its assumption, not a fit
D_CLOCK_SHARE = (1 + 835 / 989) / 2
D_PRESETS = {"8B": "llama-3-8b", "70B": "llama-3-70b", "405B": "llama-3.1-405b"}


@dataclass(frozen=True)
class TitanRow:
    model: str
    gpus: int
    layout: str  # as published
    dp: int  # FSDP shard degree
    tp: int
    pp: int
    local_batch: int
    global_batch: int
    checkpointing: str  # selective | full
    technique: str
    tokens_per_s_gpu: float
    memory_gib: float
    compiled: bool = False
    float8: bool = False
    async_tp: bool = False
    vpp: int = 1  # interleaved 1F1B: torchtitan's default 2 stages per rank


TABLE_D = [
    TitanRow("8B", 8, "FSDP 8", 8, 1, 1, 2, 16, "selective", "FSDP", 5762, 82.4),
    TitanRow("8B", 8, "FSDP 8", 8, 1, 1, 2, 16, "selective", "+ torch.compile", 6667, 77.0, compiled=True),
    TitanRow("8B", 8, "FSDP 8", 8, 1, 1, 2, 16, "selective", "+ compile + Float8", 8532, 76.8, compiled=True,
             float8=True),
    TitanRow("8B", 128, "FSDP 128", 128, 1, 1, 2, 256, "selective", "FSDP", 5605, 67.0),
    TitanRow("8B", 128, "FSDP 128", 128, 1, 1, 2, 256, "selective", "+ torch.compile", 6514, 62.0, compiled=True),
    TitanRow("8B", 128, "FSDP 128", 128, 1, 1, 2, 256, "selective", "+ compile + Float8", 8380, 61.8,
             compiled=True, float8=True),
    TitanRow("70B", 256, "FSDP 32, TP 8", 32, 8, 1, 16, 512, "full", "compile + Float8, 2D", 829, 71.9,
             compiled=True, float8=True),
    TitanRow("70B", 256, "FSDP 32, TP 8", 32, 8, 1, 16, 512, "full", "+ AsyncTP", 876, 67.6, compiled=True,
             float8=True, async_tp=True),
    TitanRow("405B", 512, "FSDP 8, TP 8, PP 8", 8, 8, 8, 32, 256, "full", "compile + Float8 + AsyncTP, 1F1B", 100,
             82.5, compiled=True, float8=True, async_tp=True),
    TitanRow("405B", 512, "FSDP 8, TP 8, PP 8", 8, 8, 8, 32, 256, "full", "same, interleaved 1F1B", 128, 72.7,
             compiled=True, float8=True, async_tp=True, vpp=2),
]


def titan_micro_batches(row: TitanRow) -> int:
    """Micro-batches per step of one pipeline: torchtitan's default at the benchmark's commit, the pipeline degree
    (pp), whatever the stages per rank; 1 without PP."""
    return row.pp if row.pp > 1 else 1


@dataclass(frozen=True)
class TitanCPRow:
    """8B on 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full AC."""

    seq: int
    dp: int
    cp: int
    tokens_per_s_gpu: float
    memory_gib: float
    gpus: int = 8


TABLE_D_CP = [TitanCPRow(32768, 8, 1, 3890, 83.9), TitanCPRow(65536, 4, 2, 2540, 84.2),
              TitanCPRow(131072, 2, 4, 1071, 84.0), TitanCPRow(262144, 1, 8, 548, 84.5)]


def titan_model(name: str, seq: int = D_SEQ) -> ModelConfig:
    return replace(get_preset(D_PRESETS[name]), max_seq_len=seq)


def published_step_d(row: TitanRow) -> float:
    """Seconds per step implied by the published TPS: global batch x seq / (GPUs x TPS)."""
    return row.global_batch * D_SEQ / (row.gpus * row.tokens_per_s_gpu)


def published_step_d_cp(row: TitanCPRow) -> float:
    """The same for a context-parallel row: dp sequences of `seq` tokens (local batch 1) per step."""
    return row.dp * row.seq / (row.gpus * row.tokens_per_s_gpu)


# ---------------------------------------------------------------------------------------------------
# E. MosaicML llm-foundry, MPT, FSDP FULL_SHARD, H100 80GB, bf16

FOUNDRY = Table(
    "E", "llm-foundry MPT, FSDP FULL_SHARD, H100 80GB, bf16",
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md (H100 80GB BF16 table); model shapes: "
    "scripts/train/yamls/pretrain/mpt-*.yaml",
    "MPT as the yamls give it: FFN 4h (expansion ratio 4), GELU, no biases, LayerNorm, tied embeddings, "
    "vocabulary 50,368, no dropout; positions planned as learned (the table's NumParams grow by "
    "(seq - 2048) x d_model with the sequence: a position table, not ALiBi). Composer's amp_bf16 with FSDP "
    "mixed precision DEFAULT (bf16 compute, fp32 sharded parameters, fp32 reduce and AdamW states: the "
    "planner's `amp` recipe; the parameters gathered in bf16, DEFAULT's param_dtype as PURE's, so autocast "
    "casts no weight); FULL_SHARD = ZeRO-3 over all GPUs, FSDP1's: gathered into its flat parameters in "
    "place and the gradients cast to the reduce dtype on its post-backward stream (no FSDP2 copies on the "
    "compute stream: fsdp_copies off), each micro-batch's gradients reduce-scattered as its backward runs "
    "(Composer's trainer holds back gradient sync only for DDP, its no_sync context: composer/trainer/trainer.py, "
    "_train_microbatch, at the table's time and since: --fsdp-grad-sync micro-batch), and each block's "
    "backward gather issued only once the block after it has run back (FSDP1's BACKWARD_POST, Composer's default "
    "where the yamls and submit_benchmarks.py set none: fsdp_config.get('backward_prefetch', 'BACKWARD_POST') in "
    "composer/trainer/dist_strategy.py at the table's time: --fsdp-prefetch post); the loss MPT's default, "
    "loss_fn fused_crossentropy (flash-attn 1.0.9's cross-entropy, not in place: it saves the bf16 logits and "
    "writes one bf16 gradient; llmfoundry/models/mpt/modeling_mpt.py and setup.py at v0.3.0, the branch "
    "submit_benchmarks.py installs: --loss-kernel flash-attn); activation checkpointing "
    "True = full, "
    "False = none (the 3b and 1b rows: False, HFU = MFU); attention at FlashAttention-2's rates, where the "
    "runs used llm-foundry's Triton flash attention (attn_impl: triton in the MPT yamls and the default of "
    "scripts/train/benchmarking/submit_benchmarks.py at b2a43a1, the commit that published the table, on "
    "the image mosaicml/pytorch:2.1.0_cu121): no H100 rate is published for that kernel, and FlashAttention-2's "
    "paper measures it slower than FlashAttention-2 on the A100, so these rows' attention is if anything "
    "planned fast; DGX H100 nodes")
FOUNDRY_VOCAB = 50368
MPT_SHAPES = {  # d_model, n_heads, n_layers (scripts/train/yamls/pretrain/mpt-*.yaml)
    "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
    "30b": (7168, 64, 48), "70b": (8192, 64, 80),
}


@dataclass(frozen=True)
class FoundryRow:
    model: str
    seq: int
    gpus: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    checkpointing: bool
    tokens_per_s_gpu: float
    mfu: float
    hfu: float | None
    num_params: int  # published NumParams


TABLE_E = [
    FoundryRow("70b", 2048, 64, 8, 4, 2048, True, 1039, 0.4257, 0.5676, 64862437376),
    FoundryRow("30b", 2048, 32, 14, 3, 1344, True, 2308, 0.4392, 0.5857, 29975214080),
    FoundryRow("13b", 2048, 64, 2, 1, 128, False, 4800, 0.3986, None, 12853954560),
    FoundryRow("13b", 4096, 8, 10, 3, 240, True, 4717, 0.416, 0.5547, 12864440320),
    FoundryRow("7b", 2048, 8, 6, 1, 48, False, 10643, 0.4644, None, 6658859008),
    FoundryRow("7b", 8192, 8, 8, 2, 128, True, 6935, 0.3714, 0.4952, 6684024832),
    FoundryRow("3b", 2048, 64, 6, 3, 1152, False, 22525, 0.408, None, 2651837440),
    FoundryRow("1b", 2048, 64, 20, 1, 1280, False, 44402, 0.4085, None, 1315950592),
]


def mpt(name: str, seq: int) -> ModelConfig:
    d, heads, layers = MPT_SHAPES[name]
    return ModelConfig(name=f"MPT-{name}", vocab_size=FOUNDRY_VOCAB, d_model=d, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads, ffn_hidden=4 * d, activation="gelu", norm="layernorm", position="learned",
                       bias=False, dropout=0.0, max_seq_len=seq, tie_embeddings=True)


def published_step_e(row: FoundryRow) -> float:
    """Seconds per step implied by the published tokens/s per GPU: global batch x seq / (GPUs x tokens/s/GPU)."""
    return row.global_batch * row.seq / (row.gpus * row.tokens_per_s_gpu)


TABLES = [MEGATRON_R08, NEMO_2407, NEMO_LONG, BRIDGE_2511, TORCHTITAN_2412, FOUNDRY]
