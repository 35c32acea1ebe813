"""--speculator-model at start-up: speculator heads detected from config.json as TGI detects
them (the architecture MLPSpeculatorPreTrainedModel: IBM's MLP speculator,
shard/engine/mlp_speculator.py; `medusa_num_heads`: Medusa, shard/engine/medusa.py), EAGLE-3
heads by their architecture (LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM,
shard/engine/eagle3.py), else a draft model loaded beside the target, or refused in one line.

The draft is loaded by the target's loading code (shard/models: get_model), on the same ranks,
in the same dtype, with the same attention backend: a tensor-parallel draft is sharded like the
target, and every rank runs its forwards in the same order (its collectives line up). Its own
checkpoint's quantization is detected as any model's (--quantize is the target's).

Refused: a draft whose tokenizer differs from the target's (a draft's token id would mean
another text: its drafts would be verified exactly but almost never kept, which is a
configuration error to say, not a slow server to discover), an encoder-decoder on either side
(their decoders do not take the varlen steps drafting and verification run), a draft with a
learned position table shorter than the target's context, and anything the loader refuses.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.engine.draft_model import DraftModel
from pytgi_shard.engine.eagle3 import Eagle3Drafter
from pytgi_shard.engine.hidden_drafter import (
    HiddenStateDrafter,
    SpeculatorHeads,
    read_safetensors,
)
from pytgi_shard.engine.medusa import read_heads
from pytgi_shard.engine.mlp_speculator import read_mlp_speculator
from pytgi_shard.models import get_model
from pytgi_shard.models.encoder_decoder_model import EncoderDecoderModel
from pytgi_shard.models.llama.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    check_head,
    default_aux_layers,
    is_eagle3,
)
from pytgi_shard.models.llama.model import Llama, LlamaDecoderLayer
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.settings import ShardSettings
from pytgi_shard.weights.conversion import ConversionError, convert_directory

log = logging.getLogger(__name__)

# config.json's architecture of IBM's MLP speculators (TGI's detection).
MLP_SPECULATOR = "MLPSpeculatorPreTrainedModel"


class SpeculatorRefused(ValueError):
    """A --speculator-model this target cannot draft with: one line, naming why."""


def load_draft_model(
    settings: ShardSettings, target: Model, detokenizer: Detokenizer, dtype: torch.dtype,
    dist: Dist,
) -> DraftModel | HiddenStateDrafter | Eagle3Drafter | None:
    """The drafter of --speculator-model; None without the flag."""
    path = settings.speculator_model
    if path is None:
        return None
    flag = f"--speculator-model {path}"
    if isinstance(target, EncoderDecoderModel):
        raise SpeculatorRefused(f"{flag}: {target.model_type} is an encoder-decoder, which "
                                "does not speculate")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and (raw.get("architectures") or [None])[0] == MLP_SPECULATOR:
        return load_heads(flag, path, raw, target, dtype, settings.speculate, "mlp-speculator")
    if isinstance(raw, dict) and "medusa_num_heads" in raw:
        return load_heads(flag, path, raw, target, dtype, settings.speculate, "medusa")
    if isinstance(raw, dict) and "speculators_model_type" in raw:
        raise SpeculatorRefused(
            f"{flag}: a checkpoint in the speculators library's format "
            f"({raw['speculators_model_type']}) is not read; use the head's original "
            "checkpoint (for EAGLE-3: config.json's architecture LlamaForCausalLMEagle3)")
    if isinstance(raw, dict) and is_eagle3(raw):
        try:
            return load_eagle3(path, raw, target, dtype, settings.block_size, settings.speculate)
        except (ValueError, OSError, ConversionError) as e:
            raise SpeculatorRefused(f"{flag}: {e}") from e
    try:
        config = ModelConfig.read(path)
        theirs = Detokenizer.from_model_dir(path, config.raw)
    except (ValueError, OSError) as e:
        raise SpeculatorRefused(f"{flag}: {e}") from e
    difference = vocabulary_difference(detokenizer, theirs)
    if difference is not None:
        raise SpeculatorRefused(f"{flag}: its tokenizer is not the target's ({difference})")
    try:
        draft = get_model(
            config, dtype=dtype, dist=dist, trust_remote_code=settings.trust_remote_code,
            attention=settings.attention or "reference",
        )
    except (ValueError, OSError, NotImplementedError, KeyError) as e:
        raise SpeculatorRefused(f"{flag}: {e}") from e
    if isinstance(draft, EncoderDecoderModel):
        raise SpeculatorRefused(f"{flag}: {draft.model_type} is an encoder-decoder; a draft "
                                "model is a decoder")
    if draft.image_layout is not None:
        raise SpeculatorRefused(f"{flag}: {draft.model_type} is a vision-language model; a draft "
                                "model drafts from token ids alone (use a text model)")
    if draft.learned_positions and draft.max_position_embeddings < target.max_position_embeddings:
        raise SpeculatorRefused(
            f"{flag}: its learned position table ({draft.max_position_embeddings}) is shorter "
            f"than the target's context ({target.max_position_embeddings})"
        )
    log.info("draft model %s (%s, %d layers) proposes up to %d tokens per sequence and step",
             path, draft.model_type, draft.num_layers, settings.speculate)
    return DraftModel(draft, target.vocab_size, settings.block_size)


def load_heads(
    flag: str, path: Path, config: dict[str, Any], target: Model, dtype: torch.dtype,
    speculate: int, kind: str,
) -> HiddenStateDrafter:
    """Speculator heads on the target's last hidden state (shard/engine/hidden_drafter.py):
    Medusa's or the MLP speculator's, `kind`."""
    lm_head = getattr(target, "lm_head", None)
    hidden_size = getattr(getattr(target, "config", None), "hidden_size", None)
    if not isinstance(lm_head, nn.Module) or not isinstance(hidden_size, int):
        raise SpeculatorRefused(f"{flag}: {kind} heads need one of pytgi's own decoders (an "
                                f"LM head on the last hidden state); {target.model_type} has none")
    read = read_mlp_speculator if kind == "mlp-speculator" else read_heads
    try:
        heads: SpeculatorHeads = read(path, config, dtype, target.device, hidden_size)
    except (ValueError, OSError) as e:
        raise SpeculatorRefused(f"{flag}: {e}") from e
    if len(heads) < speculate:
        log.warning("%s has %d %s heads: at most %d drafts per step (--speculate %d)",
                    path, len(heads), kind, len(heads), speculate)
    log.info("%s heads %s: %d drafts per step at most", kind, path, len(heads))
    return HiddenStateDrafter(kind, heads, lm_head, target.vocab_size)


def load_eagle3(path: Path, raw: dict[str, Any], target: Model, dtype: torch.dtype,
                block_size: int, speculate: int) -> Eagle3Drafter:
    """An EAGLE-3 head on a Llama-style target (shard/engine/eagle3.py); a ValueError, in one
    line, for a head or target that does not fit. A head published as pytorch_model.bin is
    converted to safetensors once, beside it, as a model's weights are."""
    if not isinstance(target, Llama):
        raise ValueError(f"EAGLE-3 heads need one of pytgi's Llama-style decoders (their layers' "
                         f"hidden states); {target.model_type} is not one")
    config = Eagle3Config.from_dict(raw)
    layers = len(target.layers)
    aux = config.aux_layers or default_aux_layers(layers)
    if len(aux) != 3 or len(set(aux)) != 3 or not all(0 <= j <= layers for j in aux):
        where = "its" if config.aux_layers else "EAGLE-3's default"
        raise ValueError(f"{where} target layers {tuple(aux)} are not three distinct layers "
                         f"of the target's {layers} (0..{layers})")
    convert_directory(path)
    tensors = {name.removeprefix("model."): t for name, t in read_safetensors(path).items()}
    hidden = target.config.hidden_size
    check_head(config, tensors, hidden, target.vocab_size)
    device = target.device
    weights = {name: t.to(device=device, dtype=torch.long if name == "d2t" else dtype)
               for name, t in tensors.items() if name != "t2d"}
    first = target.layers[0]
    assert isinstance(first, LlamaDecoderLayer)
    backend = first.self_attn.backend
    head = Eagle3Head(config, weights, backend, device)
    table = head.embed_tokens
    embed = target.embed_tokens if table is None else (
        lambda ids: nn.functional.embedding(ids, table))
    log.info("EAGLE-3 head %s: target layers %s, %d draft tokens, %d drafts per step at most",
             path, tuple(sorted(aux)), config.draft_vocab_size, speculate)
    return Eagle3Drafter(head, list(target.layers), aux, embed, block_size, dtype, device)


def vocabulary_difference(ours: Detokenizer, theirs: Detokenizer) -> str | None:
    """Why two tokenizers do not map the same texts to the same ids (None: they do): their
    vocabularies, added tokens included, compared id for id."""
    a = ours.tokenizer.get_vocab(with_added_tokens=True)
    b = theirs.tokenizer.get_vocab(with_added_tokens=True)
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(b)} tokens against the target's {len(a)}"
    differ = sum(1 for token, i in a.items() if b.get(token) != i)
    return f"{differ} of its {len(b)} tokens have other ids"
