"""`data.*`: where prompts come from. Keys follow verl's `data` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel


class SyntheticTaskConfig(ConfigModel):
    """A built-in task with verifiable answers, generated from a seed (no downloads)."""

    name: Literal["addition", "copy", "tool_add"] = "addition"
    """Task: `addition` (two-number sums, answer after `####`), `copy` (repeat a digit string) or
    `tool_add` (sums as chat prompts, for a policy with the calculator tool `add(a, b)`;
    multi-turn)."""
    num_train: int = 4096
    """Training prompts generated."""
    num_val: int = 128
    """Held-out validation prompts generated (a disjoint seed)."""
    digits: int = 2
    """Digits per operand (addition) or string length (copy)."""
    seed: int = 0
    """Seed of the generator."""
    length_tail_alpha: float | None = Field(default=None, gt=0)
    """`copy` only: heavy-tailed string lengths, Pareto with this shape (P(len > x) = (digits / x)^alpha,
    len >= digits, capped at `max_digits`); null: every string has `digits`."""
    max_digits: int | None = Field(default=None, ge=1)
    """Longest string with `length_tail_alpha`; null: 8 * digits."""

    @model_validator(mode="after")
    def _check_tail(self) -> SyntheticTaskConfig:
        if self.length_tail_alpha is not None and self.name != "copy":
            raise ValueError("data.synthetic.length_tail_alpha applies to the copy task only; set data.synthetic.name=copy "
                             "or length_tail_alpha=null")
        if self.max_digits is not None and self.max_digits < self.digits:
            raise ValueError(f"data.synthetic.max_digits={self.max_digits} is below digits={self.digits}; raise it")
        return self


class DataConfig(ConfigModel):
    """Prompt data. Files are JSONL or verl's parquet layout (`prompt` as chat messages,
    `data_source`, `ability`, `reward_model.ground_truth`, `extra_info`)."""

    train_files: list[str] = []
    """Training files (JSONL or parquet). Empty: use `data.synthetic`."""
    val_files: list[str] = []
    """Validation files. Empty: the synthetic task's held-out split (if any)."""
    synthetic: SyntheticTaskConfig | None = SyntheticTaskConfig()
    """Built-in task used when `data.train_files` is empty; null to require files."""
    prompt_key: str = "prompt"
    """Column with the prompt: a list of chat messages or a string."""
    max_prompt_length: int = Field(default=512, ge=1)
    """Prompt token budget."""
    max_response_length: int = Field(default=512, ge=1)
    """Response token budget (max new tokens per sample)."""
    train_batch_size: int = 0
    """verl's colocated batch size in prompts. Fully async requires 0 (batches are
    `ppo_mini_batch_size * require_batches`); the other modes may set it only to the prompts of one
    weight version, `ppo_mini_batch_size * require_batches * trigger_parameter_sync_step` (checked)."""
    gen_batch_size: int = 1
    """Prompts per generation unit; only 1 is supported (as in verl's fully async)."""
    shuffle: bool = True
    """Shuffle prompts each epoch."""
    seed: int = 1
    """Seed of the shuffle."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """What to do with prompts longer than `max_prompt_length`."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than `max_prompt_length` tokens when loading (the model's tokenizer,
    the chat template applied as the rollout does; train and val; before the shuffle)."""
    return_raw_chat: bool = True
    """Keep prompts as chat messages (the rollout applies the chat template)."""
    reward_fn_key: str = "data_source"
    """Column that routes the reward function."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("gen_batch_size")
    @classmethod
    def _gen_batch_one(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only 1 is supported (one prompt group per generation unit); set data.gen_batch_size=1")
        return value

