"""The batched engine: continuous batching of speculative decoding, one target forward per step for every sequence."""

from verispec.engine.engine import Engine
from verispec.engine.generate_batch import generate_batch
from verispec.engine.request import FINISH_REASONS, Request, Update
from verispec.stats import EngineMetrics

__all__ = ["Engine", "EngineMetrics", "FINISH_REASONS", "Request", "Update", "generate_batch"]
