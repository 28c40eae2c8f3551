"""Pandera models of the files passed between stages, one class per file (see DESIGN.md).

Each stage validates the frame it is about to write (and may validate what it reads), so a
malformed file fails the job that made it, not a later one. Pandera validates data only on
collected frames: call `validate` on a `pl.DataFrame`, not a `LazyFrame`.

Sections follow the order of the pipeline; add a stage's model in its section.
"""

from __future__ import annotations

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

# ---------------------------------------------------------------------------------------------
# prompts: results/{run}/prompts/{shard}.parquet (and prompts/all.parquet, the full ordered list)
# ---------------------------------------------------------------------------------------------

MESSAGE_ROLES = ("system", "user", "assistant")
MESSAGE_DTYPE = pl.Struct({"role": pl.String, "content": pl.String})
PROMPT_ID_PATTERN = r"^[0-9a-f]{16}$"


class PromptsSchema(pa.DataFrameModel):
    """One prompt per row, ready to send as chat `messages`.

    `messages` holds every turn up to and including the last user turn (the target writes the
    next assistant turn); a system turn may only come first. `id` is the content hash of the
    messages, so it is unique within a file and stable across runs.
    """

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    messages: pl.List(MESSAGE_DTYPE) = pa.Field(nullable=False)
    source: str = pa.Field(nullable=False)
    source_index: pl.Int64 = pa.Field(ge=0, nullable=False)

    class Config:
        strict = True  # no extra columns: later stages rely on exactly this layout
        ordered = True

    @pa.dataframe_check(error="every message list must be non-empty and end with a user turn")
    @classmethod
    def ends_with_user_turn(cls, data: PolarsData) -> pl.LazyFrame:
        last_role = pl.col("messages").list.last().struct.field("role")
        return data.lazyframe.select((last_role == "user").fill_null(False))

    @pa.dataframe_check(error=f"every role must be one of {', '.join(MESSAGE_ROLES)}")
    @classmethod
    def known_roles(cls, data: PolarsData) -> pl.LazyFrame:
        role = pl.element().struct.field("role")
        ok = pl.col("messages").list.eval(role.is_in(MESSAGE_ROLES).fill_null(False)).list.all()
        return data.lazyframe.select(ok)

    @pa.dataframe_check(error="a system turn may only be the first message")
    @classmethod
    def system_turn_first(cls, data: PolarsData) -> pl.LazyFrame:
        late_system = (pl.element().struct.field("role") == "system") & (pl.int_range(pl.len()) > 0)
        return data.lazyframe.select(pl.col("messages").list.eval(late_system).list.any().not_())

    @pa.dataframe_check(error="every message content must be a non-null string")
    @classmethod
    def content_present(cls, data: PolarsData) -> pl.LazyFrame:
        present = pl.element().struct.field("content").is_not_null()
        return data.lazyframe.select(pl.col("messages").list.eval(present).list.all())


def empty_prompts_frame() -> pl.DataFrame:
    """A frame with no rows and exactly the columns and dtypes of `PromptsSchema`."""
    return pl.DataFrame(
        schema={
            "id": pl.String,
            "messages": pl.List(MESSAGE_DTYPE),
            "source": pl.String,
            "source_index": pl.Int64,
        }
    )


# ---------------------------------------------------------------------------------------------
# generate: results/{run}/raw/{shard}.parquet
# ---------------------------------------------------------------------------------------------

IDS_DTYPE = pl.List(pl.Int64)
TOKEN_ID_COLUMNS = ("prompt_token_ids", "completion_token_ids")


def bad_token_ids(column: str, vocab_size: int | None = None) -> pl.Expr:
    """Per row: does the id list hold a null or an id outside `[0, vocab_size)` (only `>= 0` when
    the vocabulary is unknown)? False for a null list: a missing list is not a bad id."""
    bad = pl.element().is_null() | (pl.element() < 0)
    if vocab_size is not None:
        bad = bad | (pl.element() >= vocab_size)
    return pl.col(column).list.eval(bad).list.any().fill_null(False)


# journal: an answer to the same request, reused; the others were asked in the run that wrote the
# file: new (never asked), retry (only failures before), settings_changed (answered before, but
# for a request the current settings no longer send).
ROW_ORIGINS = ("journal", "new", "retry", "settings_changed")


class RawSchema(pa.DataFrameModel):
    """One row per prompt of the shard: the answer, or the terminal failure of its request.

    Rows are not judged here (validation does that); this fixes the layout: every prompt has a
    row, failures say why, and answered rows say which field carried the reasoning.
    """

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, nullable=False)
    endpoint: str = pa.Field(nullable=True)
    request: str = pa.Field(nullable=False)
    response: str = pa.Field(nullable=True)
    reasoning: str = pa.Field(nullable=True)
    content: str = pa.Field(nullable=True)
    reasoning_field: str = pa.Field(
        isin=["reasoning", "reasoning_content", "content_think_tags", "none"], nullable=False
    )
    finish_reason: str = pa.Field(nullable=True)
    prompt_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    completion_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    token_layout: str = pa.Field(nullable=True)
    token_ids_error: str = pa.Field(nullable=True)
    prompt_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    completion_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    latency_s: pl.Float64 = pa.Field(nullable=False, ge=0)
    attempts: pl.Int64 = pa.Field(nullable=False, ge=1)
    error_kind: str = pa.Field(nullable=True)
    error: str = pa.Field(nullable=True)
    # Where the row came from: reused from the journal, or asked in this run and why.
    origin: str = pa.Field(isin=list(ROW_ORIGINS), nullable=True)

    class Config:
        strict = True

    @pa.dataframe_check(error="a row has a response or an error, never both or neither")
    @classmethod
    def answer_or_error(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(
            pl.col("response").is_null() == pl.col("error_kind").is_not_null()
        )

    @pa.dataframe_check(error="a row whose token ids are unusable (token_ids_error) has no ids")
    @classmethod
    def unusable_ids_are_null(cls, data: PolarsData) -> pl.LazyFrame:
        ids_null = pl.col("prompt_token_ids").is_null() & pl.col("completion_token_ids").is_null()
        return data.lazyframe.select(pl.col("token_ids_error").is_null() | ids_null)


# ---------------------------------------------------------------------------------------------
# validate: results/{run}/samples/{shard}.parquet
# ---------------------------------------------------------------------------------------------


class SamplesSchema(pa.DataFrameModel):
    """Answers fit for training: non-empty reasoning and content, no think tags left in either
    (the parser split them), complete (not cut by max_tokens), unique ids."""

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    messages: pl.List(MESSAGE_DTYPE) = pa.Field(nullable=False)
    reasoning: str = pa.Field(nullable=False)
    content: str = pa.Field(nullable=False)
    reasoning_field: str = pa.Field(
        isin=["reasoning", "reasoning_content", "content_think_tags"], nullable=False
    )
    finish_reason: str = pa.Field(nullable=True, notin=["length"])
    prompt_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    completion_token_ids: IDS_DTYPE = pa.Field(nullable=True)
    token_layout: str = pa.Field(nullable=True)
    request: str = pa.Field(nullable=False)
    endpoint: str = pa.Field(nullable=False)
    prompt_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    completion_tokens: pl.Int64 = pa.Field(nullable=True, ge=0)
    latency_s: pl.Float64 = pa.Field(nullable=False, ge=0)

    class Config:
        strict = True
        ordered = True

    @pa.check("reasoning", "content", error="must not be empty or whitespace")
    @classmethod
    def not_blank(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col(data.key).str.strip_chars().str.len_chars() > 0)

    @pa.check("reasoning", "content", error="must not contain think tags (the parser splits them)")
    @classmethod
    def no_think_tags(cls, data: PolarsData) -> pl.LazyFrame:
        tags = pl.col(data.key).str.contains("<think>", literal=True) | pl.col(
            data.key
        ).str.contains("</think>", literal=True)
        return data.lazyframe.select(tags.not_())

    @pa.check(*TOKEN_ID_COLUMNS, error="token ids must be non-null and non-negative")
    @classmethod
    def token_ids_valid(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(bad_token_ids(data.key).not_())


def samples_schema(vocab_size: int | None) -> pa.DataFrameSchema:
    """`SamplesSchema`, with every token id also below the target's `vocab_size` when known."""
    schema = SamplesSchema.to_schema()
    if vocab_size is None:
        return schema
    in_vocab = pa.Check(
        lambda data: data.lazyframe.select(bad_token_ids(data.key, vocab_size).not_()),
        error=f"token ids must be below the target's vocabulary size {vocab_size}",
    )
    return schema.update_columns(
        {c: {"checks": [*schema.columns[c].checks, in_vocab]} for c in TOKEN_ID_COLUMNS}
    )


# ---------------------------------------------------------------------------------------------
# tokenize: results/{run}/tokens/{shard}.parquet
# ---------------------------------------------------------------------------------------------

TOKEN_SOURCES = ("server", "rebuilt")


class TokensSchema(pa.DataFrameModel):
    """The exact token sequence of each sample: prompt then completion (`<think>` unless the
    prompt opened it, reasoning, `</think>`, content, end of turn).

    The loss covers the completion: positions from `prompt_len` on (so at least one). `token_source`
    says whether the ids are the server's (`server`) or rebuilt with the tokenizer (`rebuilt`);
    `rebuild_agrees` whether a rebuild matched the server's ids (null when not compared);
    `truncated` whether the sequence was cut at tokenize.max_length.
    """

    id: str = pa.Field(str_matches=PROMPT_ID_PATTERN, unique=True, nullable=False)
    input_ids: IDS_DTYPE = pa.Field(nullable=False)
    prompt_len: pl.Int64 = pa.Field(ge=0, nullable=False)
    n_tokens: pl.Int64 = pa.Field(ge=1, nullable=False)
    token_source: str = pa.Field(isin=list(TOKEN_SOURCES), nullable=False)
    truncated: bool = pa.Field(nullable=False)
    rebuild_agrees: bool = pa.Field(nullable=True)

    class Config:
        strict = True
        ordered = True

    @pa.dataframe_check(error="n_tokens must be the length of input_ids")
    @classmethod
    def n_tokens_is_length(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("input_ids").list.len() == pl.col("n_tokens"))

    @pa.dataframe_check(error="a sequence needs a loss token (prompt_len < n_tokens)")
    @classmethod
    def has_loss_tokens(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select(pl.col("prompt_len") < pl.col("n_tokens"))

    @pa.dataframe_check(error="token ids must be non-negative")
    @classmethod
    def ids_non_negative(cls, data: PolarsData) -> pl.LazyFrame:
        return data.lazyframe.select((pl.col("input_ids").list.min() >= 0).fill_null(False))


def empty_tokens_frame() -> pl.DataFrame:
    """A frame with no rows and exactly the columns and dtypes of `TokensSchema`."""
    return pl.DataFrame(
        schema={
            "id": pl.String,
            "input_ids": IDS_DTYPE,
            "prompt_len": pl.Int64,
            "n_tokens": pl.Int64,
            "token_source": pl.String,
            "truncated": pl.Boolean,
            "rebuild_agrees": pl.Boolean,
        }
    )
