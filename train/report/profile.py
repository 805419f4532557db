"""``--profile START:STOP`` (``log.profile``): a ``jax.profiler`` trace of those steps.

The trace starts before the first compiled call that runs a step after ``START`` steps are
done and stops (after waiting for the device) once ``STOP`` steps are done, so with
``train.steps_per_call: K`` it covers whole calls. It goes to ``<run dir>/profile``
(``plugins/profile/<time>/*.xplane.pb`` and a ``*.trace.json.gz``): open the directory with
TensorBoard's profile plugin, or the ``.trace.json.gz`` in https://ui.perfetto.dev. One
line says where when it is written.
"""

from __future__ import annotations

from pathlib import Path


def parse(text: str) -> tuple[int, int]:
    """``"START:STOP"`` -> ``(START, STOP)``, two step counts with ``0 <= START < STOP``;
    raises ValueError saying what is expected."""
    parts = str(text).split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, stop = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"{text!r} is not START:STOP (two step numbers, e.g. 10:20)") from None
    if not 0 <= start < stop:
        raise ValueError(f"{text!r}: expected 0 <= START < STOP, e.g. 10:20")
    return start, stop


class Profiler:
    """Starts and stops ``jax.profiler`` around the calls of the steps asked for."""

    def __init__(self, span: tuple[int, int] | None, out: Path, echo):
        self.span, self.out, self.echo = span, out, echo
        self.active = self.done = False
        self.first = None

    @classmethod
    def from_config(cls, cfg, run_dir: Path, echo) -> Profiler:
        text = cfg.log.profile
        return cls(None if text is None else parse(text), Path(run_dir) / "profile", echo)

    def before_call(self, step: int, k: int) -> None:
        if self.span is None or self.active or self.done:
            return
        start, stop = self.span
        if start <= step < stop:
            import jax

            self.out.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.out))
            self.active, self.first = True, step

    def after_call(self, step: int, outputs) -> None:
        if self.active and step >= self.span[1]:
            self._stop(step, outputs)

    def close(self, step: int) -> None:
        """The run ended (or stopped) inside the span: write what was traced."""
        if self.active:
            self._stop(step, None)

    def _stop(self, step: int, outputs) -> None:
        import jax

        if outputs is not None:
            jax.block_until_ready(outputs)  # the device's work of the traced calls
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        self.echo(
            f"profile: steps {self.first + 1}-{step} traced to {self.out} (TensorBoard's "
            "profile plugin, or its .trace.json.gz in https://ui.perfetto.dev)"
        )
