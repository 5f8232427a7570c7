# syntax=docker/dockerfile:1
# The Kiwi image: every binary and the shim, for the Helm chart's DaemonSets and
# installer (deploy/helm/kiwi). Build from the repository root:
#   docker build -t <registry>/kiwi:0.1.0 .
# NOTE: not built in this project's CI (no container engine there); the same
# cargo command is what CI builds and tests.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The release binaries Kiwi ships: the arbiter and kiwictl, the runc wrapper and
# its hook, the device plugin, and the shim (libkiwi.so, a cdylib).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
        -p kiwi-arbiter -p kiwictl -p kiwi-oci -p kiwi-device-plugin -p kiwi-shim \
 && mkdir -p /out/bin /out/lib \
 && cp target/release/kiwi-arbiter target/release/kiwictl \
       target/release/kiwi-runtime target/release/kiwi-hook \
       target/release/kiwi-device-plugin /out/bin/ \
 && cp target/release/libkiwi.so /out/lib/

FROM debian:bookworm-slim
# util-linux (nsenter) and coreutils (install) are in the base image; the
# installer init container uses both.
COPY --from=build /out/bin/ /usr/local/bin/
COPY --from=build /out/lib/libkiwi.so /usr/local/lib/kiwi/libkiwi.so
COPY docs/install.md /usr/local/share/doc/kiwi/install.md
COPY deploy/systemd/ /usr/local/share/kiwi/systemd/
ENV KIWI_CONFIG=/etc/kiwi/config.toml
# The arbiter by default; the chart sets each container's command.
ENTRYPOINT []
CMD ["kiwi-arbiter", "--socket-dir", "/run/kiwi"]
