"""Whether a run can learn: the share of trained samples that carried a learning signal, watched per version.

GRPO-style estimators give a sample an advantage only relative to its group: a group whose rewards are all
equal (every answer wrong, or every answer right) trains nothing. A run whose every group is like that
goes through its whole budget at reward 0 and learns nothing, and nothing else in it looks wrong. The
learner reports per step `signal/nonzero_adv_frac` (samples whose advantage is nonzero) and, per group of
its batch, `signal/zero_variance_frac`, `signal/all_zero_frac`, `signal/all_max_frac` (all at the batch's
highest reward); the controller hands every learner row to `LearningSignal.observe`.

It warns once, in the console, when almost no sample (`QUIET` share) carried a signal for the first
`FIRST` versions or for `STREAK` versions in a row, saying what it means and what to try; at the end a run
of `FIRST` versions or more in which almost no sample carried one is `learned nothing: ...` in final.json
(`tidal run` exits 3; `launch.fail_without_signal = false` keeps it `completed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NOTHING_LEARNED = "learned nothing"  # final.json's status of a run that completed without a learning signal
EXIT_NOTHING_LEARNED = 3  # `tidal run`'s exit code for it (0 completed, 1 interrupted/stalled/failed, 2 refused)
QUIET = 0.01  # a version "without signal": fewer than 1 % of its samples had a nonzero advantage
FIRST = 20  # the first versions of a run that a user would notice
STREAK = 50  # or this many versions in a row, anywhere in the run

ADVICE = ("every group's rewards were equal (all wrong or all right), so the advantage estimator gives no sample a "
          "direction. Try a warm start (`tidal sft RECIPE`), an easier task or a smaller model's reach, a reward "
          "with partial credit, or an estimator that does not centre on the group (learner.train.advantage)")


@dataclass
class LearningSignal:
    versions: int = 0  # learner versions observed in this run (its metrics rows with the signal)
    quiet: int = 0  # of them, without signal
    streak: int = 0  # versions without signal in a row, up to the newest
    samples: float = 0.0  # trained samples observed
    with_signal: float = 0.0  # of them, with a nonzero advantage
    warned: str = ""  # the warning given (once per run), "" = none
    last: dict[str, float] = field(default_factory=dict)  # the newest row's signal/* scalars

    def observe(self, scalars: dict[str, float]) -> str:
        """Take one learner metrics row; the warning to give now (once per run), else ""."""
        frac = scalars.get("signal/nonzero_adv_frac")
        if frac is None:
            return ""
        self.last = {k: v for k, v in scalars.items() if k.startswith("signal/")}
        n = scalars.get("train/sequences", 0.0)
        self.versions += 1
        self.samples += n
        self.with_signal += frac * n
        if frac < QUIET:
            self.quiet += 1
            self.streak += 1
        else:
            self.streak = 0
        if self.warned:
            return ""
        if self.versions == FIRST and self.share() < QUIET:
            self.warned = f"no learning signal in the first {FIRST} versions"
        elif self.streak >= STREAK:
            self.warned = f"no learning signal for {STREAK} versions in a row (up to version {self.versions})"
        if not self.warned:
            return ""
        return f"{self.warned}: {self.describe()}; {ADVICE}"

    def describe(self) -> str:
        zv = self.last.get("signal/zero_variance_frac", 0.0)
        zero = self.last.get("signal/all_zero_frac", 0.0)
        top = self.last.get("signal/all_max_frac", 0.0)
        return (f"{100 * self.share():.1f} % of {self.samples:.0f} trained samples carried a nonzero advantage; in the "
                f"last batch {100 * zv:.0f} % of groups had equal rewards ({100 * zero:.0f} % all zero, "
                f"{100 * top:.0f} % all at the batch's best)")

    def share(self) -> float:
        return self.with_signal / self.samples if self.samples else 0.0

    def learned_nothing(self) -> str:
        """Why the run learned nothing (over at least `FIRST` versions, almost no trained sample carried a
        signal), or "" when it could or was too short to tell."""
        if self.versions < FIRST or self.share() >= QUIET:  # a smoke run of a few versions is not judged
            return ""
        return f"{self.versions} versions trained, but {self.describe()}. {ADVICE[0].upper()}{ADVICE[1:]}"

    def summary(self) -> dict[str, float]:
        """For final.json and summary.json."""
        return {"versions_observed": float(self.versions), "versions_without_signal": float(self.quiet),
                "samples": self.samples, "samples_with_signal_frac": self.share(), **self.last}
