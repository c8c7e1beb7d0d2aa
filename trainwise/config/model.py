"""[model]: a decoder-only Transformer, dense or Mixture-of-Experts. Zero in a derived field means "the
usual value", resolved once so that the planner and the trainer read the same number."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwise.config.checks import choice, divisors
from trainwise.errors import TrainwiseError

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "clamped_swiglu")
GATED = ("swiglu", "geglu", "clamped_swiglu")  # three matrices: gate, up, down
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("rope", "learned")
ATTENTIONS = ("mha", "mla")  # mha covers MHA/GQA/MQA through n_kv_heads; mla = DeepSeek latent attention
GATINGS = ("softmax", "sigmoid")
ROPE_SCALINGS = ("none", "yarn")


@dataclass
class ModelConfig:
    """A decoder-only Transformer. Zero in a derived field (ffn_hidden, n_kv_heads, head_dim) means
    "the usual value", resolved by `__post_init__` so that every reader sees the same number."""

    name: str = "trainwise-small"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # 0 = n_heads (MHA); 1 = MQA; in between = GQA
    head_dim: int = 0  # 0 = d_model // n_heads
    ffn_hidden: int = 0  # 0 = 4*d_model, or 8/3*d_model rounded up to 64 for gated activations
    activation: str = "swiglu"
    # "clamped_swiglu", gpt-oss's experts: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); alpha and limit below (gpt-oss: 1.702 and 7.0)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    position: str = "rope"
    rope_theta: float = 10000.0
    # "yarn" (Peng et al. 2023, "YaRN"): RoPE trained on rope_original_max_seq_len positions, stretched
    # rope_factor times; the yarn_ fields are transformers' rope_parameters beta_fast, beta_slow and truncate
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    tie_embeddings: bool = True
    bias: bool = False  # biases in every linear layer (GPT-2 style)
    qkv_bias: bool = False  # biases on the q/k/v projections only (Qwen2 style)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3 style)
    attention_sinks: bool = False  # a learned logit per head that joins each softmax's denominator (gpt-oss)
    # > 0: layers see only the last sliding_window positions (themselves included), except every
    # full_attention_every-th layer, which sees all (gpt-oss: 128 and 2; 0 = every layer windowed)
    sliding_window: int = 0
    full_attention_every: int = 0
    dropout: float = 0.0
    max_seq_len: int = 256
    init_std: float = 0.02
    # > 0: the loss computes the LM head's logits this many tokens at a time and recomputes them in
    # backward (trainwise.model.loss), so the fp32 B x T x V logits never exist whole. Changes memory
    # and adds one head matmul (2HV FLOPs/token); the loss and gradients stay the same. 0 = plain.
    loss_chunk_tokens: int = 0
    # Mixture-of-Experts (n_experts = 0: every layer dense)
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden: int = 0  # 0 = ffn_hidden
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    moe_every: int = 1  # MoE on every n-th layer after first_dense_layers (1 = all)
    router_gating: str = "softmax"
    router_bias: bool = False  # a choice bias per expert, set by load after each step (DeepSeek-V3's
    router_bias_rate: float = 1e-3  # e_score_correction_bias; its update speed gamma, V3 paper section 4.2)
    router_logit_bias: bool = False  # a bias on the router's logits, trained by gradients like a weight (gpt-oss)
    renormalize_top_k: bool = True
    dropless: bool = True  # every token reaches its top_k experts; false = capacity_factor applies
    capacity_factor: float = 1.25  # expert capacity = factor * tokens * top_k / n_experts (dropless=false)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    routed_scaling_factor: float = 1.0  # the routed experts' combine weights x this (DeepSeek-V3: 2.5)
    router_groups: int = 1  # experts in this many groups; a token picks among router_group_top_k groups first
    router_group_top_k: int = 1  # (DeepSeek-V3's n_group = 8, topk_group = 4: group-limited routing)
    # Attention variant; the "mla" fields follow DeepSeek-V2/V3's config.json names
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        self.validate()
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim == 0:  # MLA: RoPE turns the decoupled qk_rope_head_dim part of each head
            self.head_dim = self.qk_rope_head_dim if self.attention == "mla" else self.d_model // self.n_heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = default_ffn_hidden(self.d_model, self.activation)
        if self.n_experts and self.expert_ffn_hidden == 0:
            self.expert_ffn_hidden = self.ffn_hidden

    def _validate_mla(self) -> None:
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) <= 0:
                raise TrainwiseError(
                    f"model.attention = 'mla' needs model.{key} > 0 (DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim "
                    "64, v_head_dim 128; a small one: 32, 16, 32).")
        if self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise TrainwiseError(
                f"model.v_head_dim = {self.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim + self.qk_rope_head_dim}: trainwise pads v to the query's head dim for "
                "the flash kernels (DeepSeek-V2/V3: 128 <= 192); lower v_head_dim.")
        if self.qk_rope_head_dim % 2 or self.position != "rope":
            raise TrainwiseError("model.attention = 'mla' turns qk_rope_head_dim dimensions by RoPE: it needs "
                                 "model.position = 'rope' and an even qk_rope_head_dim.")
        if self.head_dim not in (0, self.qk_rope_head_dim):
            raise TrainwiseError(
                f"model.head_dim = {self.head_dim} must equal model.qk_rope_head_dim = {self.qk_rope_head_dim} under "
                "model.attention = 'mla' (RoPE's tables have the rotated part's width); leave it 0.")

    def _validate_ranges(self) -> None:
        """The keys that are not sizes, each in its range whether or not the model uses it (a dense model
        with moe_every = 0 is as wrong a file as an MoE one): a value outside would reach the weights as
        nan, or fail inside PyTorch without naming the key."""
        for key, usual in (("norm_eps", "1e-5"), ("rope_theta", "10000"), ("init_std", "0.02"),
                           ("routed_scaling_factor", "1.0; DeepSeek-V3: 2.5"), ("swiglu_alpha", "1.702"),
                           ("swiglu_limit", "7.0"), ("yarn_beta_fast", "32"), ("yarn_beta_slow", "1")):
            if not getattr(self, key) > 0:
                raise TrainwiseError(f"model.{key} = {getattr(self, key)} must be positive (e.g. {usual}).")
        if not self.capacity_factor > 0:
            raise TrainwiseError(
                f"model.capacity_factor = {self.capacity_factor} must be > 0 (e.g. 1.25); for routing "
                "without a capacity limit set model.dropless=true instead."
            )
        for key in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, key) >= 0:  # a negative weight would reward the imbalance the loss penalises
                raise TrainwiseError(f"model.{key} = {getattr(self, key)} must not be negative (0 = off).")
        if not self.router_bias_rate >= 0:
            raise TrainwiseError(f"model.router_bias_rate = {self.router_bias_rate} must be >= 0 (DeepSeek-V3: "
                                 "0.001; 0 keeps the choice bias fixed).")
        for key in ("moe_every", "router_groups", "router_group_top_k"):
            if getattr(self, key) < 1:
                raise TrainwiseError(f"model.{key} = {getattr(self, key)} must be at least 1 (1 = the default).")
        if not self.rope_factor >= 1:
            raise TrainwiseError(f"model.rope_factor = {self.rope_factor} must be at least 1 (1 = RoPE unstretched; "
                                 "gpt-oss: 32).")

    def _validate_sinks_windows_yarn(self) -> None:
        """YaRN, attention sinks and sliding windows (gpt-oss's) are built for multi-head attention."""
        if self.rope_scaling == "yarn" and (self.position != "rope" or self.rope_original_max_seq_len <= 0):
            raise TrainwiseError(
                f"model.rope_scaling = 'yarn' stretches RoPE trained on model.rope_original_max_seq_len positions: it "
                f"needs model.position = 'rope' (here '{self.position}') and rope_original_max_seq_len > 0 (here "
                f"{self.rope_original_max_seq_len}; gpt-oss: 4096).")
        used = [key for key, on in (("rope_scaling", self.rope_scaling != "none"),
                                    ("attention_sinks", self.attention_sinks), ("sliding_window", self.sliding_window))
                if on]
        if self.attention == "mla" and used:
            raise TrainwiseError(f"model.{used[0]} is built for model.attention = 'mha', not for DeepSeek's latent "
                                 f"attention ('mla'); unset it or use mha.")

    @property
    def gated(self) -> bool:
        """SwiGLU/GeGLU MLPs (gpt-oss's clamped SwiGLU too) have three matrices (gate, up, down), not two."""
        return self.activation in GATED

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layers before first_dense_layers stay dense; after that every moe_every-th layer is MoE."""
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_every == 0

    def is_sliding_layer(self, layer: int) -> bool:
        """With a sliding_window, every layer is windowed but each full_attention_every-th (gpt-oss: 2, so
        layers 0, 2, 4, ... are windowed and 1, 3, 5, ... see every position)."""
        if not self.sliding_window:
            return False
        return not self.full_attention_every or (layer + 1) % self.full_attention_every != 0

    def validate(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
        for key in positive:
            if getattr(self, key) <= 0:
                raise TrainwiseError(
                    f"model.{key} = {getattr(self, key)} must be a positive integer; set it with "
                    f"--set model.{key}=N (for example the default {getattr(ModelConfig, key)})."
                )
        for key in ("n_kv_heads", "head_dim", "ffn_hidden", "n_experts", "top_k", "expert_ffn_hidden",
                    "n_shared_experts", "first_dense_layers", "loss_chunk_tokens", "q_lora_rank", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window", "full_attention_every",
                    "rope_original_max_seq_len"):
            if getattr(self, key) < 0:
                raise TrainwiseError(f"model.{key} = {getattr(self, key)} must not be negative.")
        self._validate_ranges()
        choice("model.activation", self.activation, ACTIVATIONS)
        choice("model.norm", self.norm, NORMS)
        choice("model.position", self.position, POSITIONS)
        choice("model.attention", self.attention, ATTENTIONS)
        choice("model.router_gating", self.router_gating, GATINGS)
        choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.attention == "mla":
            self._validate_mla()
        self._validate_sinks_windows_yarn()
        if self.n_experts and (self.router_groups < 1 or self.n_experts % self.router_groups
                               or not 1 <= self.router_group_top_k <= self.router_groups):
            raise TrainwiseError(
                f"model.router_groups = {self.router_groups} must divide model.n_experts = {self.n_experts}, and "
                f"model.router_group_top_k = {self.router_group_top_k} must be between 1 and router_groups (1 and 1: "
                "plain top-k routing).")
        if self.head_dim == 0 and self.attention == "mha" and self.d_model % self.n_heads:
            raise TrainwiseError(
                f"model.n_heads = {self.n_heads} does not divide model.d_model = {self.d_model}: each head "
                f"gets d_model / n_heads dimensions. Pick n_heads from {divisors(self.d_model)} or set "
                "model.head_dim explicitly."
            )
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise TrainwiseError(
                f"model.n_kv_heads = {kv} does not divide model.n_heads = {self.n_heads}: grouped-query "
                f"attention shares each k/v head among n_heads / n_kv_heads query heads. Pick one of "
                f"{divisors(self.n_heads)}."
            )
        rotated = self.head_dim or self.d_model // self.n_heads  # MLA's rotated part: _validate_mla checks it
        if self.attention == "mha" and self.position == "rope" and rotated % 2:
            which = (f"model.head_dim = {self.head_dim}" if self.head_dim else
                     f"the head dimension model.d_model / model.n_heads = {self.d_model} / {self.n_heads} = "
                     f"{rotated}")
            raise TrainwiseError(f"{which} is odd, but model.position = 'rope' rotates pairs of dimensions: "
                                 "make it even, or set model.position=learned.")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainwiseError(f"model.dropout = {self.dropout} must be in [0, 1).")
        if self.top_k and not self.n_experts:
            raise TrainwiseError("model.top_k is set but model.n_experts = 0: set n_experts too for MoE.")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise TrainwiseError(
                    f"model.top_k = {self.top_k} must be between 1 and model.n_experts = {self.n_experts}: "
                    "each token is sent to top_k of the n_experts routed experts."
                )


def default_ffn_hidden(d_model: int, activation: str) -> int:
    """4H for plain MLPs; for gated ones 2/3 of 4H (same parameter count), rounded up to 64 (Llama)."""
    if activation in GATED:
        return 64 * math.ceil(8 * d_model / 3 / 64)
    return 4 * d_model
