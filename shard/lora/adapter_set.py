"""The adapters a shard serves: read at start-up (--lora-adapters) or live (LoadAdapter), each kept
in host memory and copied into a device slot while steps use it (shard/lora/residency.py).

Wire indices: a Request's adapter_index i > 0 names the adapter loaded at index i; `names[i - 1]`
is its name, "" for an index that is free (unloaded). The router picks the index of a live load,
so that every rank uses the same. Device slots are another numbering (1..max_loras), the one the
LoraLinear layers read per row: `place` maps a step's requests onto them.

Unloading an adapter that still has rows in the live batches only stops new requests for it
(they are refused at once); its weights go when its last row has left (`_purge`, at the next
load, unload or placement).

Host memory (--max-cpu-loras, vLLM's flag): by default every loaded adapter keeps its fused
pairs in host memory. With the cap, at most that many do (those on the device included): past
it, the least recently used adapter that is neither on the device nor in use by a live row
drops its pairs (`_trim`) and stays loaded by name and directory; a step that needs it re-reads
it from there (read, check, fuse: tens of milliseconds on the engine thread) before any slot
changes, so a failed re-read refuses that step and leaves the device as it was.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pytgi_shard.device.distributed import Dist
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.lora.attach import Sites, attach_sites, fuse
from pytgi_shard.lora.layer import RowAdapters
from pytgi_shard.lora.peft_adapter import (
    MAX_RANK,
    AdapterRefused,
    PeftAdapter,
    read_adapter,
    resolve_adapter_dir,
)
from pytgi_shard.lora.residency import Move, Pairs, SlotsExhausted, SlotTable, write_slot
from pytgi_shard.lora.spec import AdapterSpec, check_name, parse_lora_adapters
from pytgi_shard.settings import ShardSettings

log = logging.getLogger(__name__)

# --max-loras with live loading and no flag: room for this many adapters at least.
DEFAULT_MAX_LORAS = 4


class Row(Protocol):
    """A request as placement sees it (engine/request_state.py's RequestState)."""

    adapter_index: int
    adapter_slot: int


@dataclass(slots=True)
class HostAdapter:
    """One loaded adapter: its fused pairs per wrapped layer, in host memory (None: dropped
    past --max-cpu-loras, re-read from `directory` when next needed)."""

    name: str
    rank: int
    pairs: Pairs | None
    # Where it was read from (None: built in memory, never dropped).
    directory: Path | None = None


class AdapterSet:
    def __init__(self, sites: Sites | None = None, max_loras: int = 0, max_rank: int = 0,
                 runtime_updates: bool = False, dtype: torch.dtype = torch.float32,
                 max_cpu_loras: int | None = None) -> None:
        self.sites = sites
        # What live loads are read as: the model's dtype.
        self.dtype = dtype
        # Bound per forward by the ModelRunner; every LoraLinear reads it.
        self.rows = sites.rows if sites is not None else RowAdapters()
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.runtime_updates = runtime_updates
        self.table = SlotTable(max_loras)
        self._host: dict[int, HostAdapter] = {}
        # Unloaded while rows still used them: gone once they have left.
        self._unloading: set[int] = set()
        # Adapters copied out of the device for another (since start).
        self.evictions = 0
        # --max-cpu-loras (None: no cap), the loaded adapters least recently used first, and
        # how many times a dropped adapter was read again (since start).
        self.max_cpu_loras = max_cpu_loras
        self._recent: OrderedDict[int, None] = OrderedDict()
        self.rereads = 0

    def __bool__(self) -> bool:
        """Whether the model carries LoRA layers (adapters loaded or loadable)."""
        return self.sites is not None

    @property
    def names(self) -> tuple[str, ...]:
        """Info's list: names[i] is wire index i + 1, "" where none is loaded."""
        top = max(self._host, default=0)
        return tuple(self._host[i].name if i in self.loaded() else ""
                     for i in range(1, top + 1))

    def loaded(self) -> frozenset[int]:
        """The wire indices a new request may name."""
        return frozenset(i for i in self._host if i not in self._unloading)

    def in_host_memory(self) -> list[int]:
        """The wire indices whose pairs are in host memory, least recently used first."""
        return [i for i in self._recent if self._host[i].pairs is not None]

    def prepare(self, adapter: PeftAdapter, directory: Path | None = None) -> HostAdapter:
        """`adapter` (read) checked against the layers and fused for them, in host memory;
        AdapterRefused (one line) when it does not fit. Touches no state: a live load runs it
        off the engine thread."""
        if self.sites is None:
            raise AdapterRefused(f"LoRA adapter {adapter.name!r}: this server has no LoRA layers "
                                 "(start it with --lora-adapters or --enable-lora-runtime-updates)")
        if adapter.rank > self.max_rank:
            raise AdapterRefused(f"LoRA adapter {adapter.name!r}: rank r={adapter.rank} exceeds "
                                 f"--max-lora-rank {self.max_rank}")
        return HostAdapter(adapter.name, adapter.rank, fuse(adapter, self.sites), directory)

    def add(self, index: int, host: HostAdapter) -> None:
        """Keeps a prepared adapter at wire index `index`; the device gets it when a step needs
        it. AdapterRefused for a taken index or name."""
        if index < 1 or index in self._host:
            raise AdapterRefused(f"LoRA adapter {host.name!r}: index {index} is taken")
        if any(h.name == host.name for i, h in self._host.items() if i in self.loaded()):
            raise AdapterRefused(f"LoRA adapter {host.name!r} is already loaded")
        self._host[index] = host
        self._recent[index] = None

    def read(self, name: str, source: str) -> HostAdapter:
        """LoadAdapter's first half, off the engine thread: the PEFT adapter at `source` (a
        directory or a Hub id, fetched through the cache) read, checked and fused, or
        AdapterRefused naming the reason (the checks of start-up)."""
        if not self.runtime_updates:
            raise AdapterRefused("LoRA runtime updates are off (--enable-lora-runtime-updates)")
        check_name(name)
        directory = resolve_adapter_dir(AdapterSpec(name, source), None, None)
        return self.prepare(read_adapter(name, directory, self.dtype), directory)

    def install(self, index: int, host: HostAdapter, busy: Collection[int]) -> None:
        """LoadAdapter's second half, on the engine thread between steps: selectable at
        `index`, copied to the device at once when a slot is free (no eviction for it)."""
        self._purge(busy)
        self.add(index, host)
        if len(self.table.resident()) < self.max_loras:
            self._apply(self.table.place([index], busy))
        self._trim(busy)
        log.info("LoRA adapter %s loaded at index %d: rank %d", host.name, index, host.rank)

    def unload(self, index: int, busy: Collection[int]) -> str:
        """UnloadAdapter: new requests for `index` are refused from now on; its weights go once
        no row in `busy` uses it. Its name; KeyError when nothing is loaded there."""
        if index not in self.loaded():
            raise KeyError(index)
        self._unloading.add(index)
        name = self._host[index].name
        self._purge(busy)
        log.info("LoRA adapter %s at index %d unloaded%s", name, index,
                 " (its live rows finish first)" if index in self._unloading else "")
        return name

    def place(self, requests: Iterable[Row], busy: Collection[int]) -> None:
        """Gives each request the device slot of its adapter, copying in (and evicting, least
        recently used idle first) what this step needs. `busy`: the wire indices with rows in
        the live batches, which stay. SlotsExhausted past --max-loras."""
        rows = list(requests)
        if self.sites is None:
            return
        self._purge(busy)
        needed = [r.adapter_index for r in rows if r.adapter_index]
        self._reread(needed)
        self._apply(self.table.place(needed, busy))
        for index in needed:
            self._recent.move_to_end(index)
        self._trim(busy)
        for r in rows:
            r.adapter_slot = self.table.slot_of(r.adapter_index) or 0 if r.adapter_index else 0

    def _apply(self, moves: Iterable[Move]) -> None:
        """Carries out the table's moves: each adapter's host pairs into its slot."""
        assert self.sites is not None
        for move in moves:
            index, slot, evicted = move.index, move.slot, move.evicted
            pairs = self._host[index].pairs
            assert pairs is not None, "re-read before placing (_reread)"
            write_slot(self.sites, slot, pairs)
            if evicted is not None:
                self.evictions += 1
                log.debug("LoRA slot %d: %s evicted to host for %s", slot,
                          self._host[evicted].name, self._host[index].name)

    def _reread(self, needed: Iterable[int]) -> None:
        """Reads back, from their directories, the needed adapters dropped past --max-cpu-loras:
        before any slot changes, so a failure (AdapterRefused naming it: the files changed or
        went away) leaves the device as it was."""
        assert self.sites is not None
        for index in dict.fromkeys(needed):
            host = self._host.get(index)
            if host is None or host.pairs is not None:
                continue
            assert host.directory is not None
            try:
                adapter = read_adapter(host.name, host.directory, self.dtype)
            except (AdapterRefused, OSError) as e:
                raise AdapterRefused(f"LoRA adapter {host.name!r} was dropped from host memory "
                                     f"(--max-cpu-loras {self.max_cpu_loras}) and cannot be "
                                     f"read again from {host.directory}: {e}") from e
            host.pairs = fuse(adapter, self.sites)
            self.rereads += 1
            log.info("LoRA adapter %s read again from %s (--max-cpu-loras %s)", host.name,
                     host.directory, self.max_cpu_loras)

    def _trim(self, busy: Collection[int]) -> None:
        """Drops the pairs of the least recently used adapters off the device and without live
        rows until at most --max-cpu-loras keep theirs (resident and busy ones always keep
        them: --max-cpu-loras >= --max-loras leaves a candidate whenever over the cap)."""
        cap = self.max_cpu_loras
        if cap is None:
            return
        held = self.in_host_memory()
        for index in list(held):
            if len(held) <= cap:
                break
            host = self._host[index]
            if (self.table.slot_of(index) is not None or index in busy
                    or host.directory is None):
                continue
            host.pairs = None
            held.remove(index)
            log.debug("LoRA adapter %s dropped from host memory (--max-cpu-loras %d)",
                      host.name, cap)

    def _purge(self, busy: Collection[int]) -> None:
        """Drops the unloaded adapters whose last row has left."""
        for index in sorted(self._unloading - set(busy)):
            slot = self.table.drop(index)
            if slot is not None and self.sites is not None:
                write_slot(self.sites, slot, None)
            del self._host[index]
            self._recent.pop(index, None)
            self._unloading.discard(index)


def place_adapters(adapters: AdapterSet, requests: Iterable[Row], busy: Collection[int]) -> None:
    """AdapterSet.place for a Prefill's new requests; a step past --max-loras is the caller's
    mistake (InvalidRequest), never run with another adapter's weights."""
    try:
        adapters.place(requests, busy)
    except (SlotsExhausted, AdapterRefused) as e:
        raise InvalidRequest(str(e)) from e


def _read_startup(spec: AdapterSpec, dtype: torch.dtype) -> tuple[PeftAdapter, Path]:
    """One --lora-adapters entry read, and its directory (AdapterRefused in one line when it
    cannot be)."""
    directory = resolve_adapter_dir(spec, None, None)
    adapter = read_adapter(spec.name, directory, dtype)
    log.info("LoRA adapter %s from %s: rank %d, scale %g, %d projections", spec.name,
             directory, adapter.rank, adapter.scale, len(adapter.pairs))
    return adapter, directory


def _slot_shape(settings: ShardSettings, ranks: list[int]) -> tuple[int, int]:
    """(--max-loras, --max-lora-rank): the flags, else room for the start-up adapters (with
    runtime updates: at least DEFAULT_MAX_LORAS slots of MAX_RANK, as a later load may need);
    out of range is a start-up refusal."""
    runtime = settings.lora_runtime_updates
    max_rank = settings.max_lora_rank or (MAX_RANK if runtime else max(ranks))
    if not 0 < max_rank <= MAX_RANK:
        raise AdapterRefused(f"--max-lora-rank {max_rank} is not in 1..{MAX_RANK}")
    max_loras = settings.max_loras or (
        max(len(ranks), DEFAULT_MAX_LORAS) if runtime else len(ranks))
    if max_loras < 1:
        raise AdapterRefused(f"--max-loras {max_loras} must be >= 1")
    return max_loras, max_rank


def load_adapter_set(settings: ShardSettings, model: object, dtype: torch.dtype,
                     dist: Dist) -> AdapterSet:
    """--lora-adapters read and attached (with live loading, every projection wrapped), or
    AdapterRefused / ValueError in one line naming the adapter and the reason (the shard then
    refuses to start)."""
    specs = parse_lora_adapters(settings.lora_adapters)
    runtime = settings.lora_runtime_updates
    if not specs and not runtime:
        return AdapterSet()
    read = [_read_startup(spec, dtype) for spec in specs]
    adapters = [adapter for adapter, _ in read]
    max_loras, max_rank = _slot_shape(settings, [a.rank for a in adapters])
    cpu = settings.max_cpu_loras
    if cpu is not None and cpu < max_loras:
        raise AdapterRefused(f"--max-cpu-loras {cpu} must be >= --max-loras {max_loras} (the "
                             "adapters on the device keep their host copies)")
    sites = attach_sites(model, dist, adapters, every=runtime, slots=max_loras + 1,
                         max_rank=max_rank)
    out = AdapterSet(sites, max_loras, max_rank, runtime, dtype, cpu)
    for index, (adapter, directory) in enumerate(read, 1):
        out.add(index, out.prepare(adapter, directory))
    out._apply(out.table.place(range(1, min(len(adapters), max_loras) + 1)))
    out._trim(())
    log.info("LoRA: %d device slots of rank <= %d (%.1f MiB each, %.1f MiB in all, allocated "
             "before Warmup sizes the KV cache), %d adapters loaded%s", max_loras, max_rank,
             sites.slot_bytes() / 2**20, sites.slot_bytes() * (max_loras + 1) / 2**20,
             len(adapters), ", runtime updates on" if runtime else "")
    return out
