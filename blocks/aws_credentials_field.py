"""The pool's `aws_credentials` field, with prefect-aws (and boto3, about 0.6 s of imports)
imported only where credentials are given, read, saved or shown in a schema: never by a fresh
process that makes or loads a pool on another provider and leaves them at their default.

The field keeps its schema: its type is named lazily (`Annotated[Any, ...]` below) and given the
real `AwsCredentials` class where a schema is made or the block registered (blocks/nested_blocks.py),
so a saved pool's document and the form are those of a plain `AwsCredentials` field. Its value,
left at its default or loaded as a saved default, is `UNSET`, a stand-in that the pool turns into
`AwsCredentials()` on first read (GPUPool.__getattribute__) and before any dump (GPUPool.model_dump):
to a caller it is always the real block, as the contract says.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationError

from skytasks.providers.registry import imported

AWS_CREDENTIALS = "prefect_aws.credentials:AwsCredentials"

# `AwsCredentials().model_dump(mode="json")` of prefect-aws 0.5-0.7 (tests/test_import_cost.py
# checks it against the installed one): a saved pool whose credentials are this (or a part of it)
# holds none. A release with other defaults only makes such pools import prefect-aws on load.
_DEFAULTS: dict[str, Any] = {
    "aws_access_key_id": None, "aws_secret_access_key": None, "aws_session_token": None, "profile_name": None,
    "region_name": None, "assume_role_arn": None,
    "aws_client_parameters": {"api_version": None, "use_ssl": True, "verify": None, "verify_cert_path": None,
                              "endpoint_url": None, "config": None},
    "assume_role_kwargs": dict.fromkeys(("RoleSessionName", "DurationSeconds", "Policy", "PolicyArns", "Tags",
                                         "TransitiveTagKeys", "ExternalId", "SerialNumber", "TokenCode",
                                         "SourceIdentity", "ProvidedContexts")),
}


class UnsetAwsCredentials:
    """A pool's credentials left at their default, not made yet (one instance: `UNSET`)."""

    __slots__ = ()

    def made(self) -> Any:
        """`AwsCredentials()`, prefect-aws imported now."""
        return aws_credentials_class()()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UnsetAwsCredentials):
            return True
        return type(other).__name__ == "AwsCredentials" and other == self.made()

    def __hash__(self) -> int:
        return hash(UnsetAwsCredentials)

    def __repr__(self) -> str:
        return "AwsCredentials()"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unset, ())

    def __copy__(self) -> UnsetAwsCredentials:
        return self

    def __deepcopy__(self, memo: Any) -> UnsetAwsCredentials:
        return self


UNSET = UnsetAwsCredentials()


def _unset() -> UnsetAwsCredentials:
    return UNSET


def aws_credentials_class() -> Any:
    return imported(AWS_CREDENTIALS)


def _imported_already() -> bool:
    return AWS_CREDENTIALS.partition(":")[0] in sys.modules


def default_aws_credentials() -> Any:
    """The field's default: `AwsCredentials()` where prefect-aws is imported already, else UNSET."""
    return UNSET.made() if _imported_already() else UNSET


def _is_default(value: Any, defaults: Any) -> bool:
    if isinstance(defaults, dict):
        return isinstance(value, dict) and set(value) <= set(defaults) and all(
            _is_default(v, defaults[k]) for k, v in value.items())
    return value is defaults or (type(value) is type(defaults) and value == defaults)


def _as_aws_credentials(value: Any) -> Any:
    """UNSET for credentials left at their default (a saved pool's default document too); the
    real block, validated, for anything else (and for everything, once prefect-aws is imported)."""
    if isinstance(value, UnsetAwsCredentials):
        return value.made() if _imported_already() else value
    if isinstance(value, dict):
        # its slug is the field's type (by the slug Prefect would import every collection to find it)
        value = {k: v for k, v in value.items() if k != "block_type_slug"}
        if not _imported_already() and _is_default(value, _DEFAULTS):
            return UNSET
    block = aws_credentials_class()
    if isinstance(value, block):
        return value
    try:
        return block.model_validate(value)
    except ValidationError as exc:  # said as pydantic says a nested model's errors, under the field
        raise ValueError("; ".join(_said(e) for e in exc.errors())) from None


def _said(error: Any) -> str:
    where = ".".join(("aws_credentials", *map(str, error["loc"])))
    got = f" (got {error['input']!r})" if error["type"] != "missing" and not isinstance(error["input"], dict) else ""
    return f"{where}: {error['msg']}{got}"


# The field's type until a schema is made (then `AwsCredentials` itself: blocks/nested_blocks.py).
LazyAwsCredentials = Annotated[Any, BeforeValidator(_as_aws_credentials)]
