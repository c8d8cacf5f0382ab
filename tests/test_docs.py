"""The README and docs/ as a reader uses them: every Python snippet runs as pasted (inside a command of
a real daemon, so a region is granted and a client finds its daemon; one fenced `python no-run`,
which needs what a test cannot have, such as a running fleet, is compiled), every `krex VERB --flag`
a page shows is a flag that verb has, and every link to a file of the repository leads to one."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess

import pytest

from .conftest import PY, ROOT, py_env, run_daemon

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w -]*)\n(.*?)^```", re.M | re.S)


def blocks(lang: str) -> list[tuple[str, str]]:
    """(page:line, body) of every fenced block whose info string is `lang`."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).strip() == lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append((f"{page.relative_to(ROOT)}:{line}", m.group(2)))
    return out


def test_the_pages_have_python_snippets() -> None:
    # the README's first use: the region script and the client (a page that lost them fails here)
    assert sum(where.startswith("README.md") for where, _ in blocks("python")) >= 2


@pytest.mark.parametrize(("where", "source"), blocks("python"), ids=[w for w, _ in blocks("python")])
async def test_python_snippet_runs_as_pasted(where: str, source: str) -> None:
    async with run_daemon("--isolation", "signal") as d, await d.client() as c:
        res = await c.run([PY, "-c", source], env=py_env(), timeout=120)
    out = (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0, f"{where} failed as pasted:\n{out}"
    if "region(" in source:  # it ran inside krex: the region was granted, not run unprotected
        assert res.report.regions, f"{where} entered no region:\n{out}"
        assert "not running under krex" not in out, out
        # and outside krex the same script still runs, unprotected, after one warning
        plain = subprocess.run([PY, "-c", source], capture_output=True, text=True, env=py_env(), timeout=120)
        assert plain.returncode == 0, f"{where} failed outside krex:\n{plain.stderr}"
        assert plain.stderr.count("not running under krex") == 1, plain.stderr


@pytest.mark.parametrize(
    ("where", "source"), blocks("python no-run"), ids=[w for w, _ in blocks("python no-run")]
)
def test_python_snippet_that_cannot_run_here_compiles(where: str, source: str) -> None:
    compile(source, where, "exec")


@functools.cache
def help_text(verb: str) -> str | None:
    """`krex VERB --help` (VERB may be a verb and its sub-verb), None where there is no such verb."""
    p = subprocess.run(
        [PY, "-m", "krex_async", *verb.split(), "--help"], capture_output=True, text=True, env=py_env()
    )
    return p.stdout if p.returncode == 0 else None


def krex_lines() -> list[tuple[str, str]]:
    """(page:line, command) of every `krex ...` command in the pages' shell and usage blocks, with
    continuation lines joined and `&&`/`;`/`|` chains split."""
    out = []
    for lang in ("sh", "text"):
        for where, body in blocks(lang):
            joined = re.sub(r"\\\n|\n(?=\s{6,}\[)", " ", body)
            for raw in joined.splitlines():
                for part in re.split(r"&&|;|\|(?!\w)", raw.split("#", 1)[0]):
                    words = part.strip().split()
                    if words and words[0] in ("krex", ".venv/bin/krex", "/usr/local/bin/krex"):
                        out.append((where, " ".join(words)))
    return out


def test_there_are_krex_commands_to_check() -> None:
    verbs = {shlex.split(cmd)[1] for _, cmd in krex_lines() if len(cmd.split()) > 1}
    assert {"serve", "run", "status", "gateway", "trace"} <= verbs, verbs


@pytest.mark.parametrize(("where", "command"), krex_lines(), ids=[w for w, _ in krex_lines()])
def test_every_flag_a_page_shows_exists(where: str, command: str) -> None:
    words = command.split()[1:]
    leading = [w for w in words[:2] if re.fullmatch(r"[a-z][a-z-]*", w)]
    leading = leading[: next((i for i, w in enumerate(words) if w not in leading), len(leading))]
    verb = next(v for n in range(len(leading), -1, -1) if help_text(v := " ".join(leading[:n])) is not None)
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(verb) or ""))
    shown = {f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(words)) if f != "--"}
    missing = sorted(shown - known)
    assert not missing, f"{where}: `krex {verb}` has no {missing} (its --help lists {sorted(known)})"


def links() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", page.read_text()):
            target = m.group(1)
            if "://" not in target and not target.startswith("mailto:"):
                out.append((str(page.relative_to(ROOT)), target))
    return out


@pytest.mark.parametrize(("page", "target"), links(), ids=[f"{p}->{t}" for p, t in links()])
def test_links_lead_to_files(page: str, target: str) -> None:
    assert ((ROOT / page).parent / target).exists(), f"{page} links to {target}, which is not there"
