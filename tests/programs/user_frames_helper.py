"""A module of the user's project that the script imports: it travels by value."""


def helper_fails() -> None:
    config = {"lr": 0.1}
    return config["epochs"]  # the helper's own line
