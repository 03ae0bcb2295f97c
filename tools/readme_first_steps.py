"""Run the README's "First steps" shell commands as a new user would, in the checkout, in order.

Each command of the section's ``bash`` blocks runs through ``bash -c`` from the repository root with
a time limit, and its exit status must be the one its comment states (``exit 1``, ``1 ...``); a
command whose comment states none must exit 0. Placeholders the README writes in capitals (``CKPT``,
``OUT``, ``DIR``) stand for one fresh path each, under a temporary folder, the same path wherever the
same placeholder appears. Everything else runs verbatim, so the commands leave in the checkout what
they leave for a user (the ignored ``reports/<command>-<timestamp>/`` folders), and the test command
that follows in CI meets a checkout in the state the README leaves it in.

Usage: ``python tools/readme_first_steps.py [--timeout-s 900] [--list]``; exit 0 when every command
ended as its comment says, 1 otherwise (each mismatch named), 2 when the section cannot be found.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## First steps"
PLACEHOLDER = re.compile(r"\b(CKPT|OUT|DIR)\b")
#: the exit status a comment states: "exit 1", "exit 0", or a leading "0:"/"1:" list (the first)
STATED_EXIT = (re.compile(r"\bexit (\d+)\b"), re.compile(r"^\s*(\d+):"))


def first_steps_commands(readme: str) -> list[tuple[str, int]]:
    """The (command, expected exit status) pairs of the README's first-steps bash blocks, in order."""
    start = readme.find(SECTION)
    if start < 0:
        return []
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start:end if end > 0 else len(readme)]
    commands: list[tuple[str, int]] = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            found_comment = re.search(r"\s#(\s|$)", line)
            command = (line[:found_comment.start()] if found_comment else line).strip()
            comment = line[found_comment.end():] if found_comment else ""
            if not command or command.startswith("#"):
                continue
            expected = 0
            for pattern in STATED_EXIT:
                found = pattern.search(comment)
                if found:
                    expected = int(found.group(1))
                    break
            commands.append((command, expected))
    return commands


def with_paths(command: str, scratch: Path) -> str:
    """``command`` with each capitalised placeholder replaced by its path under ``scratch``."""
    return PLACEHOLDER.sub(lambda m: str(scratch / m.group(1).lower()), command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit for each command")
    parser.add_argument("--list", action="store_true", help="print the commands and their expected status")
    args = parser.parse_args(argv)
    commands = first_steps_commands((ROOT / "README.md").read_text())
    if not commands:
        print(f"error: README.md has no '{SECTION}' section with bash blocks", file=sys.stderr)
        return 2
    if args.list:
        for command, expected in commands:
            print(f"{expected}  {command}")
        return 0
    failures = []
    with tempfile.TemporaryDirectory(prefix="readme-first-steps-") as scratch:
        for command, expected in commands:
            line = with_paths(command, Path(scratch))
            began = time.monotonic()
            try:
                run = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True,
                                     timeout=args.timeout_s, stdin=subprocess.DEVNULL)
                status = run.returncode
                tail = (run.stderr or run.stdout or "").strip().splitlines()[-3:]
            except subprocess.TimeoutExpired:
                status, tail = 124, [f"still running after {args.timeout_s:.0f} s"]
            took = time.monotonic() - began
            ok = status == expected
            print(f"{'ok ' if ok else 'BAD'} exit {status} (expected {expected}) {took:6.1f} s  {command}",
                  flush=True)
            if not ok:
                failures.append(command)
                for text in tail:
                    print(f"      {text}", flush=True)
    print(f"README first steps: {len(commands) - len(failures)} of {len(commands)} ended as stated")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
