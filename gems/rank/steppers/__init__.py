"""How one rank runs a training step: the :class:`Stepper` protocol and its implementations, one a module."""
from gems.rank.steppers.base import Parts, Stepper
from gems.rank.steppers.graphed import GraphedStepper
from gems.rank.steppers.pipeline import PipelineStepper
from gems.rank.steppers.plain import PlainStepper

__all__ = ["GraphedStepper", "Parts", "PipelineStepper", "PlainStepper", "Stepper"]
