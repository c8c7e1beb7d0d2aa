"""Headless Chromium for the tests that render a page (report.html, the compare page): Debian's package,
started as the workplace's probe does (no sandbox as root, no background networking on a closed network)."""

from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"


def chromium_command(profile: Path, *extra: str) -> list[str]:
    """The command line up to the page: a fresh profile under `profile`, then `extra` flags. Without
    Chromium the calling test fails, saying how to install it (.ci/run installs it), rather than passing
    with the page unchecked."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"headless Chromium is not installed ({CHROMIUM} is missing): apt-get install -y chromium",
                    pytrace=False)
    return [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=5000", *extra]
