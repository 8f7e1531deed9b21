"""The figures the docs quote, rendered from docs/figures.json.

docs/figures.json is written by `python -m experiments.record_figures`: for
each recorded command its wall time, the conditions it ran under (date,
cores, load average, a memcpy reference, versions) and, for the main job,
its printed summary verbatim and its key figures. A *slot* is a place in a
file (the README, an experiment's docstring) whose text is rendered from
that JSON instead of typed by hand: `problems` lists the slots that
disagree with it (tests/test_figures.py), `rewrite` renders them
(`record_figures --write_readme`).

Stdlib only, no flags: the test imports it without absl or JAX.
"""

import dataclasses
import difflib
import json
import os
import textwrap
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES_JSON = "docs/figures.json"
MAIN_JOB = "pp1_pipeline"
# What the recorder can run, main job first; each at its defaults.
COMMANDS = (MAIN_JOB, "acceptance", "bench_core")
MEMCPY_BYTES = 10 ** 7          # the machine-speed reference: 10 MB

Figures = dict[str, typing.Any]


def load(path: str = os.path.join(ROOT, FIGURES_JSON)) -> Figures:
  with open(path) as f:
    return json.load(f)


def record_command(command: str) -> str:
  """The recorder's command line that records `command` again."""
  return "python -m experiments.record_figures" + (
      "" if command == MAIN_JOB else f" --commands={command}")


def measured(entry: Figures) -> str:
  """A recorded run's conditions, as a runtime quote states them."""
  c = entry["conditions"]
  return (f"measured {c['date']} on {c['nproc']} cores with load average "
          f"{c['load_average_before'][0]:.1f} before and "
          f"{c['load_average_after'][0]:.1f} after (memcpy of 10 MB: "
          f"{c['memcpy_10mb_ms_before']:.2f} ms before, "
          f"{c['memcpy_10mb_ms_after']:.2f} ms after)")


def rounds_seconds(entry: Figures) -> tuple[float, float]:
  """(start-up + compile + worker start-up, the rounds) of the main job's
  time split, seconds."""
  split = entry["figures"]["time_s"]["split"]
  start = sum(split.get(k, 0.0) for k in ("start-up", "compile",
                                           "worker start-up"))
  rounds = sum(split.get(k, 0.0) for k in ("wait", "verification", "host"))
  return start, rounds


def _runtime_paragraph(command: str) -> typing.Callable[[Figures], str]:
  def render(entry: Figures) -> str:
    return (f"Runtime with the defaults: {entry['wall_s']:.0f} s, "
            f"{measured(entry)}; docs/figures.json, recorded by "
            f"`{record_command(command)}`.")
  return render


def _main_job_docstring(entry: Figures) -> str:
  start, rounds = rounds_seconds(entry)
  return (_runtime_paragraph(MAIN_JOB)(entry) + " Of the "
          f"{entry['figures']['time_s']['wall']:.1f} s its summary counts, "
          f"start-up, compile and worker start-up took {start:.1f} s and the "
          f"{entry['figures']['rounds']} rounds {rounds:.1f} s; --tokens "
          "scales only the rounds.")


def _main_job_comment(entry: Figures) -> str:
  return (f"Runtime: {entry['wall_s']:.0f} s, {measured(entry)}; "
          "docs/figures.json.")


def _sample_output(entry: Figures) -> str:
  return "\n".join(entry["stdout"]).strip("\n")


def _after_sample(entry: Figures) -> str:
  start, rounds = rounds_seconds(entry)
  return (f"In the run above, start-up, compile and worker start-up took "
          f"{start:.1f} s of its {entry['figures']['time_s']['wall']:.1f} s "
          f"and its {entry['figures']['rounds']} rounds {rounds:.1f} s "
          "(the process, from the interpreter's start to its exit, "
          f"{entry['wall_s']:.1f} s).")


@dataclasses.dataclass(frozen=True)
class Slot:
  """A place in `path` rendered from the figures of `command`.

  The slot starts at the one line that begins with `prefix + lead`. A
  paragraph slot runs to the end of that paragraph (the following lines
  that begin with `prefix` and have text after it) and is compared with
  its rendering whitespace-insensitively, so a re-wrap is not a change.
  A fenced slot is the body of the ``` block after the lead's paragraph,
  compared line for line.
  """
  path: str
  lead: str
  command: str
  render: typing.Callable[[Figures], str]
  prefix: str = ""
  width: int = 76
  fenced: bool = False

  def where(self) -> str:
    return f"{self.path} ({self.lead!r})"


SLOTS = (
    Slot("README.md", "Runtime:", MAIN_JOB, _main_job_comment, prefix="# "),
    Slot("README.md", "Sample output of the main job", MAIN_JOB,
         _sample_output, fenced=True),
    Slot("README.md", "In the run above,", MAIN_JOB, _after_sample),
    Slot("experiments/pp1_pipeline.py", "Runtime with the defaults:",
         MAIN_JOB, _main_job_docstring, width=78),
    Slot("experiments/acceptance.py", "Runtime with the defaults:",
         "acceptance", _runtime_paragraph("acceptance"), width=78),
    Slot("experiments/bench_core.py", "Runtime with the defaults:",
         "bench_core", _runtime_paragraph("bench_core"), width=78),
    Slot("docs/benchmarks.md", "Runtime with the defaults:", "bench_core",
         _runtime_paragraph("bench_core")),
)


class SlotError(ValueError):
  """A slot cannot be found in its file, or has no recorded figures."""


def _span(lines: list[str], slot: Slot) -> tuple[int, int]:
  """[start, end) of the slot's lines."""
  starts = [i for i, line in enumerate(lines)
            if line.startswith(slot.prefix + slot.lead)]
  if len(starts) != 1:
    raise SlotError(f"{slot.where()}: {len(starts)} lines start with it, "
                    "not one")
  end = starts[0] + 1
  while end < len(lines) and lines[end].startswith(slot.prefix) and (
      lines[end][len(slot.prefix):].strip()):
    end += 1
  if not slot.fenced:
    return starts[0], end
  while end < len(lines) and not lines[end].strip():
    end += 1
  if end == len(lines) or not lines[end].startswith("```"):
    raise SlotError(f"{slot.where()}: no ``` block after it")
  close = end + 1
  while close < len(lines) and lines[close] != "```":
    close += 1
  if close == len(lines):
    raise SlotError(f"{slot.where()}: its ``` block is not closed")
  return end + 1, close


def _entry(figures: Figures, slot: Slot) -> Figures:
  entry = figures.get("commands", {}).get(slot.command)
  if entry is None:
    raise SlotError(f"{slot.where()}: docs/figures.json has no figures of "
                    f"{slot.command} (`{record_command(slot.command)}`)")
  return entry


def _lines(slot: Slot, text: str) -> list[str]:
  if slot.fenced:
    return text.split("\n")
  return textwrap.wrap(text, slot.width, initial_indent=slot.prefix,
                       subsequent_indent=slot.prefix,
                       break_long_words=False, break_on_hyphens=False)


def _words(slot: Slot, lines: list[str]) -> str:
  return " ".join(" ".join(line[len(slot.prefix):] for line in lines).split())


def problem(text: str, slot: Slot, figures: Figures) -> str | None:
  """What is wrong with the slot in `text` (None: it agrees)."""
  try:
    lines = text.split("\n")
    start, end = _span(lines, slot)
    want = slot.render(_entry(figures, slot))
  except SlotError as e:
    return str(e)
  found = lines[start:end]
  where = f"{slot.path}:{start + 1}: disagrees with docs/figures.json"
  if slot.fenced:
    diff = list(difflib.unified_diff(want.split("\n"), found, "recorded",
                                     "found", n=0, lineterm=""))
    return "\n".join([where, *diff]) if diff else None
  want, found_words = " ".join(want.split()), _words(slot, found)
  if want == found_words:
    return None
  return f"{where}\n  recorded: {want}\n  found:    {found_words}"


def rewrite(text: str, slot: Slot, figures: Figures) -> str:
  """`text` with the slot rendered from `figures` (raises SlotError)."""
  lines = text.split("\n")
  start, end = _span(lines, slot)
  lines[start:end] = _lines(slot, slot.render(_entry(figures, slot)))
  return "\n".join(lines)


def _read(root: str, path: str) -> str:
  with open(os.path.join(root, path)) as f:
    return f.read()


def problems(figures: Figures, root: str = ROOT) -> list[str]:
  """Every slot of the docs that disagrees with `figures`."""
  found = (problem(_read(root, s.path), s, figures) for s in SLOTS)
  return [p for p in found if p]


def rewrite_files(figures: Figures, root: str = ROOT) -> list[str]:
  """Renders every slot into its file; the paths whose text changed. Every
  slot is rendered before any file is written (a SlotError writes none)."""
  texts = {}
  for slot in SLOTS:
    if slot.path not in texts:
      texts[slot.path] = _read(root, slot.path)
    texts[slot.path] = rewrite(texts[slot.path], slot, figures)
  changed = [path for path, text in texts.items()
             if text != _read(root, path)]
  for path in changed:
    with open(os.path.join(root, path), "w") as f:
      f.write(texts[path])
  return changed
