"""The CoE domain: experts, the model spec, requests, chains and verdicts.

This package imports none of the others (and never torch), so every other
package can depend on it cheaply.
"""
from .errors import CoEError, ExpertLoadError, SpecError
from .expert import Component, Expert
from .request import Frame, Request, StepError, StepOutput, Verdict, finite_problem
from .spec import CoEModel, load_spec, parse_spec
from .chain import Decision, decide

__all__ = [
    "CoEError", "CoEModel", "Decision", "decide", "Component", "Expert", "ExpertLoadError", "Frame", "Request",
    "SpecError", "StepError", "StepOutput", "Verdict", "finite_problem", "load_spec", "parse_spec",
]
