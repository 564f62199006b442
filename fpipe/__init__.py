"""fpipe: pipeline-parallel training in PyTorch as a functional transform.

``step = fpipe.pipeline(loss_fn, stages, schedule)`` turns pure stage functions
``stage(params_i, x) -> y`` and a schedule (plain data, see ``fpipe.schedules``) into
``loss, grads = step(params, batch)``.
"""

from . import schedules as schedules
from ._api import Step as Step
from ._api import pipeline as pipeline
from ._errors import PipelineError as PipelineError
from ._errors import PipelineTimeoutError as PipelineTimeoutError
from ._functionalize import functionalize as functionalize
from ._load import load as load
from ._save import save as save

__all__ = [
    "PipelineError",
    "PipelineTimeoutError",
    "Step",
    "functionalize",
    "load",
    "pipeline",
    "save",
    "schedules",
]
