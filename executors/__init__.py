"""Executors: the scheduler, executor threads, module skeletons, prefetch and model backends."""
from .executor import BatchResult, Executor, FailedExperts
from .scheduler import Batch, FixedCosts, Scheduler

__all__ = ["Batch", "BatchResult", "Executor", "FailedExperts", "FixedCosts", "Scheduler"]
