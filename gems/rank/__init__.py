"""What every rank runs (``gems.worker`` bootstraps the world and calls :func:`gems.rank.loop.train`): its state built
once (setup), the loop over its steps (loop), the step (steppers, composed by compose), what follows a step (hooks).
docs/design.md, "A rank's run", maps the modules."""
