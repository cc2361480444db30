"""@rules_java for Bazel 4 offline: Bazel's own JDK tools load their Java rules from here, and Bazel would fetch
this repository from GitHub. These are the native rules, as rules_java's defs.bzl of Bazel 4's time was."""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
