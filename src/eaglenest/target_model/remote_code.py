"""The target's own Python code (`trust_remote_code`): when it fails to import, an error that says
which target, which transformers and which import, instead of a traceback deep in transformers.

Remote code is written against the transformers of its day: Kimi-K2.5's tokenizer has imported
`bytes_to_unicode` from `transformers.models.gpt2.tokenization_gpt2`, which transformers 5.24 no
longer has (it lives in `transformers.convert_slow_tokenizer`)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path


class RemoteCodeError(ImportError):
    """The target's remote code does not import under this transformers; the message says why."""


def failing_import_line(err: BaseException, code_dir: Path) -> str:
    """`file:line: source` of the deepest frame in the target's own code (transformers copies it to
    its modules cache as `transformers_modules/...`), or "" when the traceback has none."""
    local = {p.name for p in code_dir.glob("*.py")} if code_dir.is_dir() else set()
    frames = [
        frame
        for frame in traceback.extract_tb(err.__traceback__)
        if "transformers_modules" in frame.filename or Path(frame.filename).name in local
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}: {(frame.line or '').strip()}"


@contextlib.contextmanager
def remote_code_errors(what: str, target_name: str, code_dir: Path) -> Iterator[None]:
    """Turn an ImportError raised while transformers loads `what` (e.g. "tokenizer") of the target
    from `code_dir` into a RemoteCodeError naming the target, transformers' version and the
    failing import."""
    try:
        yield
    except ImportError as err:
        import transformers

        where = failing_import_line(err, code_dir)
        raise RemoteCodeError(
            f"the {what} of target '{target_name}' ({code_dir}) does not import under "
            f"transformers {transformers.__version__}: "
            f"{where + ' -> ' if where else ''}{err}. Its remote code (target.trust_remote_code) "
            "was written for another transformers: use a revision of the model whose code "
            "imports under this one, or patch the import in its file; turning trust_remote_code "
            "off is no way out (transformers then loads a generic class whose ids may differ)"
        ) from err
