"""The registry finds plugins through real `tidal` entry points and explains every miss."""

from __future__ import annotations

import textwrap

import pytest

from tidal.core import PluginConflict, PluginNotFound
from tidal.core.interfaces import Environment, Task
from tidal.core.plugins import KINDS, Registry, TidalSpecs, hookimpl


def write_plugin_dist(root, dist: str, entry: str, module: str, source: str) -> None:
    """Lay out an installed distribution (dist-info + module) the way pip would, on a path entry."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tidal]\n{entry} = {module}\n")


PLUGIN = """
    from tidal.core.interfaces import Task
    from tidal.core.plugins import hookimpl

    class EchoEnv:
        def tasks(self, split, seed):
            while True:
                yield Task(prompt="say hi", answer="hi")

        def score(self, task, completion):
            return float(completion.strip() == task.answer)

    @hookimpl
    def tidal_envs():
        return {"echo": EchoEnv}

    @hookimpl
    def tidal_rewards():
        return {"exact-match": lambda task, completion: float(completion == task.answer)}
"""


def test_plugin_from_an_entry_point_is_found(tmp_path, monkeypatch):
    write_plugin_dist(tmp_path, "tidal-test-echo", "test-echo", "tidal_test_echo", PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    env = reg.create("env", "echo")
    assert isinstance(env, Environment)  # satisfies the kind's Protocol
    task = next(env.tasks("train", 0))
    assert env.score(task, "hi") == 1.0
    assert reg.get("reward", "exact-match")(Task(prompt="", answer="x"), "x") == 1.0
    assert reg.provider("env", "echo") == "test-echo"
    assert reg.table()["env"]["echo"] == "test-echo"


def test_unknown_name_lists_the_registered_ones(tmp_path, monkeypatch):
    write_plugin_dist(tmp_path, "tidal-test-echo", "test-echo", "tidal_test_echo", PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    with pytest.raises(PluginNotFound, match=r"no env named 'ecoh'; registered env names: (.*, )?echo(, .*)?\. Did you mean 'echo'\?"):
        reg.get("env", "ecoh")
    with pytest.raises(PluginNotFound, match="unknown plugin kind 'engines'; kinds are: engine, env"):
        reg.get("engines", "x")


def test_empty_kind_says_which_package_provides_builtins():
    reg = Registry(load_entry_points=False)
    with pytest.raises(PluginNotFound, match=r"\(none\).*pip install tidal-weight-sync"):
        reg.get("weight_transport", "zmq")


def test_a_broken_plugin_is_reported_and_does_not_hide_the_others(tmp_path, monkeypatch):
    write_plugin_dist(tmp_path, "tidal-test-echo", "test-echo", "tidal_test_echo", PLUGIN)
    write_plugin_dist(tmp_path, "tidal-test-broken", "test-broken", "tidal_test_broken", "import not_a_module_at_all\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    assert "echo" in reg.names("env")  # the working plugin is still found beside the broken one
    with pytest.raises(PluginNotFound, match="test-broken: ModuleNotFoundError"):
        reg.get("env", "other")


def test_two_plugins_claiming_one_name_conflict():
    class A:
        @hookimpl
        def tidal_policy_losses(self):
            return {"ppo": object}

    class B:
        @hookimpl
        def tidal_policy_losses(self):
            return {"ppo": object}

    reg = Registry(load_entry_points=False)
    reg.register(A(), "plugin-a")
    reg.register(B(), "plugin-b")
    with pytest.raises(PluginConflict, match="'ppo' is registered by both plugin 'plugin-a' and plugin 'plugin-b'"):
        reg.names("policy_loss")


def test_every_kind_has_a_hookspec():
    for kind, hook in KINDS.items():
        assert hasattr(TidalSpecs, hook), kind


class _Levels:
    def __init__(self, level: int = 1, seed: int = 0) -> None:
        if level not in (1, 2):
            raise ValueError(f"levels are 1 or 2, got {level}")
        self.level = level


class _Forwarding:
    @hookimpl
    def tidal_envs(self):
        def levels(**options):  # forwards its options, as lazy built-in factories do
            return _Levels(**options)

        return {"levels": levels}


def test_build_names_the_field_and_what_the_plugin_takes():
    from tidal.core.errors import ConfigError

    reg = Registry(load_entry_points=False)
    reg.register(_Forwarding(), name="fwd")
    assert reg.build("env", "levels", {"level": 2}, field="domains[0]", name_key="env").level == 2
    with pytest.raises(ConfigError) as e:
        reg.build("env", "levles", {}, field="domains[0]", name_key="env")
    assert e.value.field == "domains[0].env" and "Did you mean 'levels'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        reg.build("env", "levels", {"levl": 2}, field="domains[1]", name_key="env")
    text = str(e.value)
    assert e.value.field == "domains[1].options" and "levl" in text and "it takes: level, seed" in text
    with pytest.raises(ConfigError, match=r"refused the options at `domains\[0\]\.options`.*levels are 1 or 2, got 9"):
        reg.build("env", "levels", {"level": 9}, field="domains[0]")


def test_a_type_error_from_inside_the_plugin_is_its_bug_not_a_bad_option():
    from tidal.core.plugins import PluginBuildError

    class Broken:
        @hookimpl
        def tidal_envs(self):
            def broken():
                return len(3)  # a bug in the plugin, not a bad option

            return {"broken": broken}

    reg = Registry(load_entry_points=False)
    reg.register(Broken(), name="broken")
    with pytest.raises(PluginBuildError) as e:
        reg.build("env", "broken", {}, field="domains[0]")
    text = str(e.value)
    assert "failed to build: TypeError: object of type 'int' has no len()" in text and "options" not in text, text
    assert isinstance(e.value.__cause__, TypeError)


LAZY = """
    from tidal.core.plugins import hookimpl

    def lazy(**options):
        from acme_lazy_env.backend import Backend  # the dependency is imported only when the env is built
        return Backend()

    @hookimpl
    def tidal_envs():
        return {"lazy": lazy}
"""


def test_a_module_that_fails_to_import_in_the_factory_is_one_line_naming_field_plugin_module_and_line(
        tmp_path, monkeypatch):
    from tidal.core.plugins import PluginBuildError

    package = tmp_path / "acme_lazy_env"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "backend.py").write_text("# a backend on a library that is not installed\nimport not_installed_xyz\n")
    write_plugin_dist(tmp_path, "acme-lazy", "acme-lazy", "acme_lazy_plugin", LAZY)
    (tmp_path / "acme_lazy_plugin.py").rename(package / "plugin.py")
    (tmp_path / "acme_lazy-0.1.dist-info" / "entry_points.txt").write_text("[tidal]\nacme-lazy = acme_lazy_env.plugin\n")
    (tmp_path / "acme_lazy-0.1.dist-info" / "RECORD").write_text("acme_lazy_env/__init__.py,,\nacme_lazy_env/plugin.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    with pytest.raises(PluginBuildError) as e:
        reg.build("env", "lazy", {}, field="domains[0]", name_key="env")
    assert str(e.value) == ("domains[0]: environment plugin 'lazy' (module acme_lazy_env.plugin, distribution "
                            "acme-lazy) failed to build: ModuleNotFoundError: No module named 'not_installed_xyz' "
                            "(acme_lazy_env/backend.py:2)")
    assert e.value.field == "domains[0]" and e.value.where == "acme_lazy_env/backend.py:2"


def test_a_plugin_that_fails_to_import_eagerly_is_reported_with_the_authors_line(tmp_path, monkeypatch):
    write_plugin_dist(tmp_path, "tidal-test-broken", "test-broken", "tidal_test_broken",
                      "# needs a library that is not installed\nimport not_a_module_at_all\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginNotFound, match=r"test-broken: ModuleNotFoundError.* at tidal_test_broken\.py:2\)"):
        Registry().get("env", "broken")
