"""The `tidal` command."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from tidal.core.plugins import KINDS, registry
from tidal.core.protocol import PROTOCOL_VERSION


def _versions() -> dict[str, str]:
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name == "tidal" or name.startswith("tidal-"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def cmd_plugins(args: argparse.Namespace) -> int:
    table = registry.table()
    kinds = [args.kind] if args.kind else list(KINDS)
    for kind in kinds:
        if kind not in table:
            print(f"unknown kind {kind!r}; kinds are: {', '.join(KINDS)}", file=sys.stderr)
            return 2
        entries = table[kind]
        print(f"{kind}:")
        if not entries:
            print("  (none installed)")
        for name, provider in entries.items():
            print(f"  {name:<24} from {provider}")
    for name, error in registry.failed.items():
        print(f"plugin {name} failed to load: {error}", file=sys.stderr)
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"Tidal wire protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}")
    for name, version in _versions().items():
        print(f"{name} {version}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidal",
        description="Tidal: asynchronous RL post-training for LLMs.",
        epilog="Run `tidal COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list the installed plugins of every kind and who provides them")
    p.add_argument("kind", nargs="?", help=f"only this kind ({', '.join(KINDS)})")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("version", help="show the protocol version and the installed tidal packages")
    p.set_defaults(func=cmd_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
