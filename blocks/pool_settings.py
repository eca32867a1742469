"""A GPU pool's provider settings, as the block holds them: one pydantic model per provider, the
block's `settings` field a plain `Union` of them.

Why models in a plain Union: Prefect's form (3.9) renders such a field as tabs, one per model,
with the chosen model's fields below, so a person sees the pool's common fields and a choice of
provider, then that provider's fields only. A pydantic `discriminator` would render the field as a
raw JSON box, and provider blocks of their own (a Union of Block types: a picker of saved blocks)
would make every pool two saved documents and a person save the settings first; settings are
rarely shared between pools, and credentials, which are, stay blocks of their own
(`aws_credentials`, `kubernetes_credentials`). Each model carries a `provider` tag, so a saved
document says which provider it is for without a discriminator.

From Python the flat keywords of the contract stay shorthand (`GPUPool(provider="ssh",
hosts=[...])`): `settings_from_flat` maps them, and a pool saved before the settings existed (its
document flat) loads through the same mapping. A keyword nothing takes is a PoolConfigError
naming it and the nearest field.
"""

from __future__ import annotations

import difflib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any, Mapping, Union

from prefect.blocks.fields import SecretDict
from pydantic import BaseModel, BeforeValidator, Secret, ValidationError

from skytasks.errors import PoolConfigError
from skytasks.preflight.fields import FLAT_LIMITS

from skytasks.providers.registry import PROVIDERS, plugin, readers_of_fields
from skytasks.providers.settings_model import ProviderSettingsModel


# Each provider's settings model, named by its plugin, in the order of the provider table: the
# form's tabs, local (the default) first. A provider's fields are thus named in its spec.py alone.
SETTINGS: dict[str, type[ProviderSettingsModel]] = {name: p.settings_model for name, p in PROVIDERS.items()}
LocalSettings = SETTINGS["local"]  # (its old import path: skytasks.blocks.pool_settings)

if TYPE_CHECKING:
    from skytasks.providers.local.spec import LocalSettings as LocalSettings  # noqa: F811
    ProviderSettings = ProviderSettingsModel
else:
    ProviderSettings = Union[tuple(SETTINGS.values())]

# Every provider setting by its flat name (the contract's keyword), with its default.
FLAT: dict[str, Any] = {}
for _model in SETTINGS.values():
    for _name, _info in _model.model_fields.items():
        if _name != "provider":
            FLAT.setdefault(_name, _info)


def flat_default(name: str) -> Any:
    """The default of a provider setting, as a pool whose provider does not take it reads it."""
    info = FLAT[name]
    return info.default_factory() if info.default_factory is not None else info.default


def no_such_field(name: str, known: set[str], listed: list[str]) -> str:
    """`nodess: no such field; did you mean nodes?` (difflib's nearest of every field, when one is
    near; else the fields this pool takes)."""
    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else f"; this pool takes {', '.join(listed)}"
    return f"{name}: no such field{hint}"


def _either(names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def foreign_field(name: str, provider: str) -> str:
    readers = readers_of_fields()[name]
    return (f"{name}: only provider {_either(readers)} takes it, not provider={provider!r} (a field of another "
            "provider is never ignored silently)")


def _settings_provider(given: Any, provider: Any) -> str:
    """Which provider a pool is for: its settings' tag (or, for a document without one, the only
    provider whose settings hold all its keys), else the `provider` keyword, else local."""
    tag = given.get("provider") if isinstance(given, Mapping) else getattr(given, "provider", None)
    if given is not None and tag is None and isinstance(given, Mapping):
        fits = [n for n, model in SETTINGS.items() if set(given) <= set(model.model_fields)]
        tag = fits[0] if len(fits) == 1 or (fits and provider not in fits) else None
    if tag is not None and provider is not None and tag != provider:
        raise ValueError(f"provider: {provider!r}, but the settings given are provider {tag!r}'s")
    name = tag or provider or "local"
    if not isinstance(name, str) or name not in PROVIDERS:
        plugin(str(name))  # the registry's own error: unknown provider, naming the known ones
    return name


# Where a document saved before the settings existed held a secret, which a document saved over
# it may still hold (see `settings_from_flat`): the block's schema lists it as a secret field.
STALE_SECRETS = ("ssh_private_key",)

# Whether the input being validated is a saved document (GPUPool.model_validate, as Block.load
# calls it) rather than keywords from Python.
LOADING_DOCUMENT: ContextVar[bool] = ContextVar("skytasks_loading_a_saved_pool", default=False)


def settings_from_flat(data: Mapping[str, Any], pool_field_order: list[str], document: bool = False) -> dict[str, Any]:
    """A pool's input (keywords, a saved document of either form) with its provider settings in
    `settings`, as the chosen provider's model. Raises ValueError naming the first key nothing
    takes (a typo) or another provider's setting given a value."""
    data, pool_fields = dict(data), set(pool_field_order)
    if document and "settings" in data:
        # A document saved over a flat one keeps the flat one's keys beside its own (Prefect's
        # update merges the stored data's top level): `settings` says what the pool is now.
        data = {k: v for k, v in data.items() if k not in FLAT and k != "provider"}
    given, provider = data.pop("settings", None), data.pop("provider", None)
    name = _settings_provider(given, provider)
    model = SETTINGS[name]
    known = pool_fields | set(FLAT) | {"provider"}
    listed = ["provider", *(f for f in pool_field_order if f != "settings"), *(f for f in model.model_fields if f != "provider")]
    data.pop("block_type_slug", None)  # a saved document's own type (Prefect dispatches on it before this)
    if isinstance(given, BaseModel):
        values = {k: getattr(given, k) for k in type(given).model_fields}
    else:
        values = dict(given or {})
        for key in values:
            if key not in model.model_fields:
                raise ValueError(foreign_field(key, name) if key in FLAT else no_such_field(key, known, listed))
    for key in [k for k in data if k not in pool_fields]:
        value = data.pop(key)
        if key in model.model_fields:
            values[key] = value
        elif key in FLAT:
            if not _same(value, flat_default(key)):  # a flat document holds every field, at its default
                raise ValueError(foreign_field(key, name))
        else:
            raise ValueError(no_such_field(key, known, listed))
    values["provider"] = name
    try:
        data["settings"] = model.model_validate(values)
    except ValidationError as exc:  # said by the flat name a person typed, as before the settings existed
        raise ValueError(field_errors(exc)) from None
    return data


SECRET = ("env", "ssh_private_key")  # an error about these never repeats the value given


def field_errors(exc: ValidationError) -> str:
    """pydantic's errors as `field: what is wrong (got value)`, one per line, the field first."""
    lines = []
    for e in exc.errors():
        field = ".".join(str(part) for part in e["loc"])
        text = e["msg"].removeprefix("Value error, ")
        if field and not text.startswith((field + ":", field + ".")):  # a nested block's error names its part
            shown = e["type"] != "missing" and not isinstance(e["input"], dict) and not field.startswith(SECRET)
            got = f" (got {e['input']!r})" if shown else ""
            text = f"{field}: {text}{got}"
        lines.append(text)
    return "; ".join(lines)


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, Secret) or hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    return bool(value == default)


def _env_values(value: Any) -> Any:
    """`env` as given (a mapping of names to strings, or a SecretDict), checked, for its SecretDict."""
    if isinstance(value, Secret):
        value = value.get_secret_value()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("env: a mapping of variable names to string values")
    return value


# `env` is a SecretDict, as Prefect's own blocks hold secret mappings (Webhook.headers): its values
# are secret fields of the block's schema ("env.*"), so the API and the UI show them obfuscated, a
# repr shows none, and a pool saved before (a plain mapping) still loads.
SecretEnv = Annotated[SecretDict, BeforeValidator(_env_values)]


def aws_environment(creds: Any) -> dict[str, str]:
    """The pool's AWS credentials as the standard variables boto3 reads on a rank (for
    `skytasks.Checkpointer("s3://...")` and the user's own boto3 calls). Only what is set: an
    unset block leaves the node's own chain (an instance profile) in charge. Never logged."""
    secret = creds.aws_secret_access_key
    values = {
        "AWS_ACCESS_KEY_ID": creds.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret is not None else None,
        "AWS_SESSION_TOKEN": creds.aws_session_token,
        "AWS_DEFAULT_REGION": creds.region_name,
        "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url if creds.aws_client_parameters else None,
    }
    return {k: str(v) for k, v in values.items() if v}


class FlatSettingNames:
    """The contract's flat names of a pool's provider settings, read and set through its settings
    model: `pool.hosts`, `pool.hosts = [...]` (GPUPool's, a mixin before Block)."""

    if TYPE_CHECKING:
        settings: ProviderSettingsModel
        provider: str

    def __getattr__(self, name: str) -> Any:
        # `pool.hosts`, `pool.k8s_image`: a provider setting by its flat name, as before the
        # settings had a model of their own; one the pool's provider does not take reads as its
        # default (a local pool's hosts are []), as it did then.
        if name in FLAT_LIMITS:
            return getattr(self.__dict__["preflight_limits"], name)
        if name in FLAT:
            settings = self.__dict__.get("settings")
            if settings is not None and name in type(settings).model_fields:
                return getattr(settings, name)
            return flat_default(name)
        return super().__getattr__(name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        # `pool.hosts = [...]` sets the provider's setting, checked, in a settings model of its own
        # (a copy of the pool keeps the settings it had); another provider's is refused, naming it.
        if name in FLAT:
            settings = self.settings
            if name not in type(settings).model_fields:
                raise PoolConfigError(foreign_field(name, self.provider))
            values = {k: getattr(settings, k) for k in type(settings).model_fields}
            try:
                value = type(settings).model_validate({**values, name: value})
            except ValidationError as exc:
                raise PoolConfigError(field_errors(exc)) from None
            name = "settings"
        super().__setattr__(name, value)
