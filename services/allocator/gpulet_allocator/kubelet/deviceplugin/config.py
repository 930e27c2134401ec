"""Settings of the kubelet device plugin.

The struct lives in :mod:`gpulet_common.settings.allocator` (the common package must
not import a service, and the allocator shares the resource names); it is re-exported
here so that the plugin's code and tests keep importing it from the plugin package.
"""

from __future__ import annotations

from gpulet_common.settings.allocator import PluginConfig as PluginConfig
