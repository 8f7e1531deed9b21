"""`chat_prompts`: the project's own chat prompts, split by a hash."""

import numpy as np
import pytest

from experiments import chat_prompts


class _Chars:
  """A stand-in tokenizer: one id per character."""

  @staticmethod
  def encode(text):
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def test_splits_are_disjoint_fixed_and_held_out_by_hash():
  train, held = chat_prompts.prompts("train"), chat_prompts.prompts(
      "held_out")
  assert not set(train) & set(held)
  assert len(train) + len(held) == len(set(train) | set(held))
  assert 0.02 < len(held) / (len(train) + len(held)) < 0.08
  assert all(chat_prompts.is_held_out(p) for p in held)
  assert chat_prompts.prompts("train") == train        # deterministic
  with pytest.raises(ValueError, match="split"):
    chat_prompts.prompts("test")


def test_held_out_prompts_are_cut_to_their_last_tokens():
  chat = lambda text: f"<s>{text}</s>"
  out = chat_prompts.held_out_prompts(_Chars(), 5, 12, 0, chat)
  assert out.shape == (5, 12) and out.dtype == np.int32
  texts = {bytes(row.astype(np.uint8)).decode() for row in out}
  assert all(t.endswith("</s>") for t in texts)
  again = chat_prompts.held_out_prompts(_Chars(), 5, 12, 0, chat)
  assert (again == out).all()
  with pytest.raises(ValueError, match="shortest"):
    chat_prompts.held_out_prompts(_Chars(), 1, 10_000, 0, chat)
