"""Several expert stores seen as one: how vision and LLM experts share the same pools.

The line's store holds the vision experts; an imported MoE model's store
holds its (layer, expert) entries.  A pool's source reads through a
`StoreUnion`, which sends each expert id to the store that has it, so one
pool (one byte budget, one policy) holds both kinds and never learns which is
which.  Ids must be unique across the stores; a clash is refused at start.
"""
from __future__ import annotations

from pathlib import Path

from coe import CoEError, ExpertLoadError

from .expert_store import ExpertStore, ManifestEntry


class StoreUnion:
    """The `ExpertStore` reading interface over several stores; `primary` is where writes and defaults go."""

    def __init__(self, primary: ExpertStore, *others: ExpertStore) -> None:
        self.primary = primary
        self.stores = (primary, *others)
        self._owner = self._index()
        self.root = primary.root
        self.verify = primary.verify

    def _index(self) -> dict[str, ExpertStore]:
        owner: dict[str, ExpertStore] = {}
        for st in self.stores:
            for e in st.entries():
                if e.id in owner:
                    raise CoEError(f"expert '{e.id}' is in two stores ({owner[e.id].root} and {st.root}); "
                                   "ids must be unique across the line's store and its LLM store")
                owner[e.id] = st
        return owner

    def _of(self, expert_id: str) -> ExpertStore:
        st = self._owner.get(expert_id)
        if st is None:
            raise ExpertLoadError(expert_id, ", ".join(str(s.root) for s in self.stores), "in none of the stores")
        return st

    def has(self, expert_id: str) -> bool:
        return expert_id in self._owner

    def entry(self, expert_id: str) -> ManifestEntry:
        return self._of(expert_id).entry(expert_id)

    def entries(self) -> list[ManifestEntry]:
        """One entry per id, from the store that serves it (as `entry` reads it)."""
        return [self._owner[i].entry(i) for i in sorted(self._owner)]

    def nbytes(self, expert_id: str) -> int:
        return self._of(expert_id).nbytes(expert_id)

    def loaded_nbytes(self, expert_id: str, dtype: str | None = None) -> int:
        return self._of(expert_id).loaded_nbytes(expert_id, dtype)

    def layout(self, expert_id: str):
        return self._of(expert_id).layout(expert_id)

    def path(self, expert_id: str) -> Path:
        return self._of(expert_id).path(expert_id) if expert_id in self._owner else self.primary.path(expert_id)

    def read(self, expert_id: str):
        return self._of(expert_id).read(expert_id)

    def read_flat(self, expert_id: str, **kw):
        return self._of(expert_id).read_flat(expert_id, **kw)

    def write(self, *args, **kw):
        eid = getattr(args[0], "id", None) if args else None
        if eid is not None and self._owner.get(eid, self.primary) is not self.primary:
            raise CoEError(f"expert '{eid}' is served from {self._owner[eid].root}; writing it into "
                           f"{self.primary.root} would put it in two stores")
        out = self.primary.write(*args, **kw)
        self._owner[out.id] = self.primary
        return out

    def reload(self) -> None:
        for st in self.stores:
            st.reload()
        self._owner = self._index()
