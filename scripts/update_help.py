"""Write the `--help` texts that `litkv --help` and `litkv COMMAND --help` print (`litkv/assets/help/`).

The stored texts let `--help` answer without importing torch or any command (`litkv/__main__.py`);
`tests/cli/test_startup.py` fails when one differs from the live parser's help. It also writes
`policies.txt`, the registered policy names that `litkv.cli.preflight` checks `--kv_cache.policy` against
before torch is imported. Run after changing a command's signature or docstring, or the built-in policies:

    python scripts/update_help.py
"""

from __future__ import annotations

from litkv.__main__ import HELP_DIR, commands, render_help
from litkv.cli.preflight import POLICIES_FILE


def main() -> None:
    HELP_DIR.mkdir(parents=True, exist_ok=True)
    for key in ("litkv", *commands()):
        path = HELP_DIR / f"{key}.txt"
        path.write_text(render_help(key), encoding="utf-8")
        print(f"wrote {path.relative_to(HELP_DIR.parents[2])}")
    from litkv.kvcache import known_policies

    POLICIES_FILE.write_text("".join(f"{name}\n" for name in known_policies()), encoding="utf-8")
    print(f"wrote {POLICIES_FILE.relative_to(HELP_DIR.parents[2])}")


if __name__ == "__main__":
    main()
