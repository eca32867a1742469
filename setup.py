"""Which packages the wheel holds; everything else about the package is in pyproject.toml.

Every package under skytasks/ is found, never listed, so a provider's folder cannot be left out.
The block's source is the repository's top-level blocks/ folder, installed as `skytasks.blocks`:
no generic top-level `blocks` package lands in site-packages (pyproject's tables cannot say both).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["skytasks", "skytasks.*"]), "skytasks.blocks"],
    package_dir={"skytasks.blocks": "blocks"},
)
