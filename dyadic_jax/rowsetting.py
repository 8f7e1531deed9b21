"""The row-mode setting's values and its environment variable, without JAX.

`rowwise` runs the modes; this module only names and checks the setting,
so that `import dyadic_jax` refuses a bad DYADIC_JAX_ROWS at once while
the package loads its JAX modules on first use.
"""

import os

ROWS_ENV = "DYADIC_JAX_ROWS"
SETTINGS = ("auto", "loop", "batched")


def check_setting(caller: str, setting: str) -> str:
  """`setting`, or ValueError naming `caller` if it is not a row mode."""
  if setting not in SETTINGS:
    raise ValueError(f"{caller}: row mode {setting!r} is not one of "
                     f"{', '.join(SETTINGS)}")
  return setting


def setting_from_env() -> str:
  """The setting DYADIC_JAX_ROWS asks for ("auto" when unset)."""
  return check_setting(f"environment variable {ROWS_ENV}",
                       os.environ.get(ROWS_ENV, "auto").strip() or "auto")
