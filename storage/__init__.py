"""Storage: the expert store on SSD, model pools and eviction policies, results DB, recordings."""
from .expert_store import ExpertStore, ManifestEntry
from .policies import EvictionPolicy, PoolState, make_policy
from .pool import Handle, Pool, PoolEvent, PoolFullError
from .recording import RecordedFrame, Recording, RecordingError, RecordingWriter
from .results import JournalEntry, ResultStore

__all__ = ["EvictionPolicy", "ExpertStore", "Handle", "JournalEntry", "ManifestEntry", "Pool", "PoolEvent",
           "PoolFullError", "PoolState", "RecordedFrame", "Recording", "RecordingError", "RecordingWriter",
           "ResultStore", "make_policy"]
