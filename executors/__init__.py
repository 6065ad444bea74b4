"""Executors: the scheduler, executor threads and model backends."""
from .executor import BatchResult, Executor, ModuleSource
from .scheduler import Batch, GroupingScheduler

__all__ = ["Batch", "BatchResult", "Executor", "GroupingScheduler", "ModuleSource"]
