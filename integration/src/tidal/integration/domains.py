"""The recipe's domains as the controller draws from them: each one's environment, its training task
stream and its held-out problems, and the checks on the tasks an environment makes."""

from __future__ import annotations

from collections.abc import Iterator

from tidal.core.errors import PluginError
from tidal.core.interfaces import Task
from tidal.rollout.envs.tasks import first_tasks


def check_task(task: object, plugin: str, where: str) -> Task:
    """A task as an environment made it, checked where the controller builds messages from it: what is
    wrong names the plugin, the field and the value (an Assignment that fails to decode on a worker
    would otherwise vanish there)."""
    if not isinstance(task, Task):
        raise PluginError(f"env {plugin!r} ({where}) yielded a {type(task).__name__}, not a tidal.core.interfaces.Task")
    for name in ("prompt", "answer", "domain"):
        value = getattr(task, name)
        if not isinstance(value, str):
            raise PluginError(f"env {plugin!r} ({where}) made a task whose `{name}` is {type(value).__name__} "
                              f"{value!r}; it must be str")
    if not isinstance(task.metadata, dict):
        raise PluginError(f"env {plugin!r} ({where}) made a task whose `metadata` is {type(task.metadata).__name__}; "
                          f"it must be dict[str, str]")
    for k, v in task.metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise PluginError(f"env {plugin!r} ({where}) made a task with metadata[{k!r}] = {v!r} "
                              f"({type(v).__name__}); task metadata must be dict[str, str]: convert it in "
                              f"the env's tasks(), e.g. {{k: str(v) for k, v in meta.items()}}")
    return task


def unencodable(tok, text: str, error: Exception) -> str:
    """What the tokenizer cannot encode in `text`: the first character that fails alone, where it is."""
    for i, ch in enumerate(text):
        try:
            tok.encode(ch)
        except Exception:
            return (f"the model's tokenizer cannot encode {ch!r} (U+{ord(ch):04X}) at position {i} of the prompt "
                    f"{text[:80]!r} ({type(error).__name__}: {error})")
    return f"the model's tokenizer cannot encode the prompt {text[:80]!r} ({type(error).__name__}: {error})"


class DomainTasks:
    """One recipe domain as the controller draws from it (the recipe's description is
    `tidal.core.config.Domain`): its environment, its training task stream, its held-out problems."""

    def __init__(self, name: str, plugin: str, env, weight: float, seed: int, eval_size: int, where: str) -> None:
        self.name, self.plugin, self.env, self.weight, self.where = name, plugin, env, weight, where
        self.train: Iterator[Task] = env.tasks("train", seed)
        self.eval: list[Task] = [check_task(t, plugin, f"{where}, eval split")
                                 for t in (first_tasks(env, "eval", seed, eval_size) if eval_size else [])]
        self.unencodable = 0  # tasks skipped in a row because the tokenizer cannot encode their prompt
