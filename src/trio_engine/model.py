"""Per-family model specs: which linear layers LoRA targets, and how logits are made.

Hugging Face causal LMs share a shape (a decoder ``trunk`` then an ``lm_head``) but not
the details that matter to us:

- LoRA targets: Llama-shaped families name their projections ``q_proj k_proj v_proj
  o_proj`` / ``gate_proj up_proj down_proj``; Phi-3 fuses them (``qkv_proj``,
  ``gate_up_proj``), so Llama names would silently adapt only ``o_proj``/``down_proj``.
- The head: some families transform the logits after ``lm_head`` (read off each
  family's ``ForCausalLM.forward`` in transformers):

    Gemma 2, Gemma 3 (text)  logits = c · tanh(logits / c),  c = config.final_logit_softcapping
    Cohere, Cohere 2         logits = logits · config.logit_scale
    Granite                  logits = logits / config.logits_scaling

  Everything before ``lm_head`` (Gemma's embedding scaling, attention soft-capping,
  Granite's residual multipliers) is inside the trunk and needs nothing from us.

A family is looked up by ``config.model_type``. An unknown family gets ``GENERIC``: every
projection name any known family uses, and a plain head. Which of those names the
model really has is checked when an adapter is created (``select_targets``), so an
unknown model either gets all the kinds of layers it asked for or an error, never a
partial adapter. A model of unknown family whose config carries one of the head
attributes above is refused (``check_head``): we would not know how it applies it; one
whose own forward makes other logits than its plain head, under whatever name, is refused
too (``check_plain_head``, a forward of a few tokens at load).

``Head`` is the one place logits are made (trainer, ``compute_logprobs`` and sampler all
call it), so the transform cannot be applied on one path and forgotten on another. It
casts ``lm_head``'s output to fp32 and transforms in fp32; transformers transforms in
the model's dtype, which is the same for fp32 models and slightly less exact for bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .catalog import ModelNotAvailableError
from .errors import InvalidInputError
from .lora import LoraConfig, LoRAExperts, LoRALinear

LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
# projections that read one input, computed as one product (``lora.SiblingGroup``)
LLAMA_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class FamilySpec:
    """One model family: its LoRA target names and its head.

    ``softcap_key`` / ``multiply_key`` / ``divide_key`` name the config attribute of a
    transform applied to ``lm_head``'s output (None: the family has none). ``siblings``:
    groups of target names one module calls on the same input (fused into one product).
    """

    name: str
    attn_targets: tuple[str, ...] = LLAMA_ATTN
    mlp_targets: tuple[str, ...] = LLAMA_MLP
    unembed_targets: tuple[str, ...] = UNEMBED
    siblings: tuple[tuple[str, ...], ...] = LLAMA_SIBLINGS
    softcap_key: str | None = None
    multiply_key: str | None = None
    divide_key: str | None = None

    def all_targets(self) -> tuple[str, ...]:
        return self.attn_targets + self.mlp_targets + self.unembed_targets

    def requested(self, config: LoraConfig) -> dict[str, tuple[str, ...]]:
        """LoraConfig field -> the target names it asks for (only fields set true)."""
        kinds = {
            "train_attn": (config.train_attn, self.attn_targets),
            "train_mlp": (config.train_mlp, self.mlp_targets),
            "train_unembed": (config.train_unembed, self.unembed_targets),
        }
        return {field: names for field, (on, names) in kinds.items() if on}

    def transform(self, hf_config: Any) -> LogitTransform:
        """The head transform with this model's constants read from its config."""

        def value(key: str | None) -> float | None:
            v = getattr(hf_config, key, None) if key else None
            return None if v is None else float(v)

        return LogitTransform(
            softcap=value(self.softcap_key),
            multiply=value(self.multiply_key),
            divide=value(self.divide_key),
        )


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to ``lm_head``'s output; the identity when all are None."""

    softcap: float | None = None
    multiply: float | None = None
    divide: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        # No family has more than one of these, so their order is moot; each is written
        # exactly as transformers writes it (divide, not multiply by the reciprocal).
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


LLAMA = FamilySpec("llama")
GEMMA2 = FamilySpec("gemma2", softcap_key="final_logit_softcapping")
PHI3 = FamilySpec("phi3", attn_targets=("qkv_proj", "o_proj"), mlp_targets=("gate_up_proj", "down_proj"),
                  siblings=())  # fused in the checkpoint already
COHERE = FamilySpec("cohere", multiply_key="logit_scale")
GRANITE = FamilySpec("granite", divide_key="logits_scaling")

FAMILIES: dict[str, FamilySpec] = {
    "llama": LLAMA,
    "mistral": FamilySpec("mistral"),
    "qwen2": FamilySpec("qwen2"),
    "qwen3": FamilySpec("qwen3"),
    "gemma": FamilySpec("gemma"),
    "gemma2": GEMMA2,
    "gemma3_text": FamilySpec("gemma3_text", softcap_key="final_logit_softcapping"),
    "phi3": PHI3,
    "cohere": COHERE,
    "cohere2": FamilySpec("cohere2", multiply_key="logit_scale"),
    "granite": GRANITE,
}


def _union(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for group in groups for name in group))


# Every name a known family uses for each kind; used for unknown families and to tell a
# PEFT folder's target_modules apart by kind. No name is of two kinds in two families.
ALL_ATTN = _union(*(f.attn_targets for f in FAMILIES.values()))
ALL_MLP = _union(*(f.mlp_targets for f in FAMILIES.values()))
GENERIC = FamilySpec("generic", attn_targets=ALL_ATTN, mlp_targets=ALL_MLP)
HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def family_of(hf_config: Any) -> FamilySpec:
    """The spec for a transformers config (``GENERIC`` for an unknown ``model_type``)."""
    return FAMILIES.get(getattr(hf_config, "model_type", ""), GENERIC)


def text_config(hf_config: Any) -> Any:
    """The config of a model's text part: a multimodal config's ``text_config`` (where
    Gemma 3's keeps the context, sliding window and RoPE), else the config itself."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


# Layer types (transformers' ``layer_types``, ``layers_block_type``) that carry no state along the
# sequence: attention of any pattern (the families of chunked or indexed attention are refused
# at load), and blocks that mix no tokens (Nemotron-H names its MLP and MoE blocks)
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention",
                              "indexed_attention", "mlp", "moe"})


def state_layers(model: nn.Module) -> list[str]:
    """What in the text forward mixes tokens outside attention, carrying a state along the
    sequence (Mamba and other SSMs, short convolutions, linear attention), by name: the
    config's other layer types, else the modules holding a causal convolution (each of
    those has one). Sequences packed in one row would run on from each other's state, and
    the sampler's cache keeps attention's keys and values alone. Empty: attention alone."""
    config = text_config(model.config)
    types = [*(getattr(config, "layer_types", None) or ()), *(getattr(config, "layers_block_type", None) or ())]
    found = dict.fromkeys(kind for kind in types if kind not in ATTENTION_LAYERS)
    if not found:
        in_text = text_forward_filter(model)
        found = dict.fromkeys(name.split(".")[-2] if "." in name else name for name, module in model.named_modules()
                              if isinstance(module, nn.Conv1d) and in_text(name))
    return list(found)


def check_head(spec: FamilySpec, hf_config: Any) -> None:
    """Refuse a generic-spec model whose config names a logit transform we'd not apply.

    Raises:
        ModelNotAvailableError: the family is unknown and its config sets one of ``HEAD_KEYS``.
    """
    if spec is not GENERIC:
        return
    config = text_config(hf_config)
    found = {k: getattr(config, k) for k in HEAD_KEYS if getattr(config, k, None) is not None}
    if found:
        raise ModelNotAvailableError(
            f"model_type {getattr(hf_config, 'model_type', None)!r} is not a known family "
            f"(known: {sorted(FAMILIES)}) and its config sets {found}, a logit transform "
            "TRIO does not know how to apply; add a FamilySpec for it in trio_engine/model.py"
        )


def context_of(hf_config: Any) -> int:
    """The most tokens one sequence may have on this model: ``max_position_embeddings``,
    except for LongRoPE (Phi-3 128k, Phi-3.5), served up to its original context.

    transformers picks LongRoPE's short or long factors once per forward call, from the
    largest position in it. Past the original context one sequence's numbers would then
    depend on the others in its batch, and a sampled sequence that crosses it would have
    its prompt's KV made with the short factors and the rest with the long ones, unlike
    the trainer's forward of the same tokens. Up to it, the short factors hold everywhere.
    """
    config = text_config(hf_config)
    context = int(getattr(config, "max_position_embeddings", 4096))
    for rope in _rope_parameter_sets(config):
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
            original = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
            context = min(context, int(original or context))
    return context


def _rope_parameter_sets(hf_config: Any) -> list[dict]:
    """The config's RoPE parameters (transformers 5 ``rope_parameters``, 4.x ``rope_scaling``),
    one dict per layer type where a model has several (Gemma 3)."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    nested = [v for v in rope.values() if isinstance(v, dict)]
    return nested or [rope]


def check_plain_head(spec: FamilySpec, model: Any) -> None:
    """Refuse a generic-spec model whose own forward makes other logits than its plain
    head does (a transform under a name ``HEAD_KEYS`` does not know, e.g. Falcon-H1's
    ``lm_head_multiplier`` or RecurrentGemma's ``logits_soft_cap``): one forward of a
    few tokens, both ways, before any adapter is installed.

    Raises:
        ModelNotAvailableError: the two differ, or the model's forward fails on token ids.
    """
    if spec is not GENERIC:
        return
    head = model.get_output_embeddings()
    probe = (torch.arange(1, 9, device=head.weight.device) * 7919 % head.weight.shape[0])[None]
    model_type = getattr(model.config, "model_type", None)
    try:
        with torch.no_grad():
            own = model(input_ids=probe, use_cache=False).logits.float()
            plain = head(model.get_decoder()(input_ids=probe, use_cache=False)[0]).float()
    except Exception as exc:  # noqa: BLE001  (any failure means we cannot serve it)
        raise ModelNotAvailableError(f"model_type {model_type!r} is not a known family and its forward "
                                     f"failed on token ids alone ({type(exc).__name__}: {exc})") from exc
    gap = float((own - plain).abs().max())
    if gap > 1e-3 * max(1.0, float(plain.abs().max())):
        raise ModelNotAvailableError(
            f"model_type {model_type!r} is not a known family and its forward transforms the logits after "
            f"lm_head (up to {gap:.3g} from lm_head's own output), in a way TRIO does not know how to "
            "apply; add a FamilySpec for it in trio_engine/model.py"
        )


def select_targets(model: nn.Module, spec: FamilySpec, config: LoraConfig) -> tuple[str, ...]:
    """The target names of ``config`` that ``model`` has as linear layers.

    An adapter covers every weight of each kind it asks for or is refused: a model the
    spec does not fully describe fails here rather than training part of what was asked.

    Raises:
        InvalidInputError: a kind of layer the config asks for (train_attn, train_mlp,
            train_unembed) matches no linear layer of the model, or only part of that kind:
            a known family missing one of its names, weights of that kind outside linear
            layers (``_refuse_weights_outside_linears``), linear layers next to the
            targets that no name covers (``_refuse_unnamed_neighbours``), or layers of the
            model without any of its targets (``_refuse_layers_without``); nothing is
            changed.
    """
    in_text = text_forward_filter(model)
    linears = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear | LoRALinear) and in_text(name)]
    # wrapped experts count as their parts' layers (``model.layers.0.mlp.experts.down_proj``)
    experts = [name for name, module in model.named_modules() if isinstance(module, LoRAExperts) and in_text(name)]
    linears += [f"{name}.{part}" for name in experts for part in LoRAExperts.PARTS]
    present = {_leaf(name) for name in linears}
    params = [name for name, _ in model.named_parameters() if in_text(name) and not _within(name, experts)]
    chosen: list[str] = []
    for field, names in spec.requested(config).items():
        _refuse_weights_outside_linears(params, field, names)
        found = [n for n in names if n in present]
        # a known family has all its names; the generic spec lists every family's names,
        # so there one name per kind is enough (a model has q_proj... or qkv_proj)
        missing = [n for n in names if n not in present] if spec is not GENERIC else []
        if not found or missing:
            raise InvalidInputError(
                f"{field}: true, but this {spec.name} model has no linear layer named "
                f"{missing or list(names)} (it needs {list(names)}); set {field}=false or "
                f"use a model of a supported family ({sorted(FAMILIES)})",
                field=field,
            )
        _refuse_unnamed_neighbours(linears, field, names, spec)
        _refuse_layers_without(linears, field, names)
        chosen += found
    return tuple(chosen)


def text_forward_filter(model: nn.Module) -> Callable[[str], bool]:
    """Whether a module or parameter path is in what a text forward runs: the decoder and
    the head, less any other model nested in the decoder. That is where a partial adapter
    matters: a multimodal model's vision tower never runs here (Gemma 3's, beside the
    decoder, or Phi-4-multimodal's image and audio encoders, inside its embedding), and
    LoRA on its ``q_proj`` just stays zero. Everything, when the model has no decoder and
    head to ask for."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_decoder) and callable(get_head)):
        return lambda name: True
    decoder, head = get_decoder(), get_head()
    paths = {id(module): name for name, module in model.named_modules()}
    if id(decoder) not in paths:
        return lambda name: True
    parts = [paths[id(m)] for m in (decoder, head) if id(m) in paths]
    prefix = paths[id(decoder)] + "." if paths[id(decoder)] else ""
    nested = [prefix + name for name, module in decoder.named_modules()
              if name and isinstance(module, PreTrainedModel)]
    return lambda name: _within(name, parts) and not _within(name, nested)


def _within(name: str, parts: list[str]) -> bool:
    return any(not part or name == part or name.startswith(part + ".") for part in parts)


def _refuse_weights_outside_linears(params: list[str], field: str, names: tuple[str, ...]) -> None:
    """Refuse ``field`` when a parameter is named as one of its targets itself rather than
    being a linear layer's ``weight`` or a part of experts that ``lora.LoRAExperts``
    wraps (``params`` leaves those out): a mixture-of-experts block's experts in another
    layout, kept as 3-D tensors (GPT-OSS's, with biases and interleaved gate and up
    projections). Qwen2-MoE's shared expert is a plain ``gate_proj``/``up_proj``/
    ``down_proj`` beside its experts, which alone would have made an adapter of one
    expert in dozens."""
    outside = [name for name in params if _leaf(name) in names]
    if outside:
        raise InvalidInputError(
            f"{field}: true, but this model keeps {_listed(outside)} as tensors outside linear layers "
            "(a mixture-of-experts block's experts) in a layout TRIO's LoRA does not adapt (it adapts "
            "experts of 3-D gate_up_proj (E, 2I, H) and down_proj (E, H, I) without biases); set "
            f"{field}=false to adapt the other kinds of layers",
            field=field,
        )


def _refuse_unnamed_neighbours(linears: list[str], field: str, names: tuple[str, ...], spec: FamilySpec) -> None:
    """Refuse ``field`` when a module holding some of its targets also holds linear layers
    that no name of the spec covers: DeepSeek's latent attention has ``kv_a_proj_with_mqa``
    and ``kv_b_proj`` next to ``q_proj`` and ``o_proj``."""
    holders = {_parent(name) for name in linears if _leaf(name) in names}
    beside = [name for name in linears if _parent(name) in holders]
    known = set(spec.all_targets())
    unnamed = [name for name in beside if _leaf(name) not in known]
    if unnamed:
        targets = sorted({_leaf(name) for name in beside if _leaf(name) in names})
        raise InvalidInputError(
            f"{field}: true, but next to its layers {targets} this model has the linear layers "
            f"{_listed(unnamed)}, which the {spec.name} spec does not name, so an adapter would leave "
            f"them out; set {field}=false, or name them in this model's FamilySpec (trio_engine/model.py)",
            field=field,
        )


def _refuse_layers_without(linears: list[str], field: str, names: tuple[str, ...]) -> None:
    """Refuse ``field`` when some of the model's numbered layers hold its targets and others
    hold linear layers but none of them: a hybrid model whose other layers mix tokens by
    another mechanism (Qwen3-Next's linear attention, in three layers of four) would get
    LoRA on part of its layers only. A layer is a path's part up to its first number
    (``model.layers.3``)."""
    has_target: dict[str, bool] = {}
    for name in linears:
        layer = _layer_of(name)
        if layer is not None:
            has_target[layer] = has_target.get(layer, False) or _leaf(name) in names
    without = [layer for layer, has in has_target.items() if not has]
    if without and len(without) < len(has_target):
        raise InvalidInputError(
            f"{field}: true, but {len(without)} of this model's {len(has_target)} layers ({_listed_layers(without)}) "
            f"have none of {list(names)}, so an adapter would cover the other layers only; set {field}=false",
            field=field,
        )


def _layer_of(path: str) -> str | None:
    """``path`` up to and including its first numbered part (None: it has none)."""
    parts = path.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[:index + 1])


def _listed_layers(layers: list[str], most: int = 4) -> str:
    shown = ", ".join(layers[:most])
    return shown + (f" and {len(layers) - most} more" if len(layers) > most else "")


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _listed(paths: list[str]) -> str:
    """The distinct layer names among ``paths``, and where the first is."""
    names = list(dict.fromkeys(_leaf(path) for path in paths))
    return f"{names} (e.g. {paths[0]})"


class Head(nn.Module):
    """hidden (N, H) -> fp32 logits (N, V): ``lm_head`` (LoRA-wrapped), then the transform.

    The product runs in the model's dtype, so a bf16 model's logits are bf16 values (their
    spacing is 0.25 at 40) before the fp32 transform and log-softmax: 0.01 nats a token on
    average, 0.07 at most, from an fp32 product of the same hidden states (the bundled model).
    Trainer and sampler round alike, so this does not part their logprobs: an fp32 product
    here (about 4x the head's cost on the CPU) left their gap for prompts prefilled together
    where it was (max 0.12-0.20 nats either way, session 34). Train in fp32 to avoid both."""

    def __init__(self, lm_head: nn.Module, transform: LogitTransform):
        super().__init__()
        self.lm_head = lm_head
        self.transform = transform

    @property
    def weight(self) -> torch.Tensor:
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(self.lm_head(hidden).float())
