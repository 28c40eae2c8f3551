"""The prompt list and its shards, `prompts/all.parquet` and `prompts/{shard}.parquet`: one prompt
per row (id, messages, source, source_index). Pandera validates data only on collected frames."""

from __future__ import annotations

import pandera.polars as pa
import polars as pl
from pandera.api.polars.types import PolarsData

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
