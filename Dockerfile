# syntax=docker/dockerfile:1
# The agent image: `docker build -t lb .` from the repository root.
#
# Build stage: `cargo xtask build` installs what the eBPF build needs (the nightly's rust-src,
# bpf-linker against the nightly's LLVM) exactly as on a developer machine, then builds the eBPF
# object and embeds it in target/release/lb.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo xtask build \
    && install -D -m 0755 target/release/lb /out/lb

# Runtime: the one binary. ca-certificates for an apiserver with a public certificate (the
# in-cluster config brings its own CA); iptables (both backends: the agent writes into the node's) for
# the agent's FORWARD rules (LB-FORWARD).
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates iptables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/lb /usr/local/bin/lb
ENTRYPOINT ["/usr/local/bin/lb"]
CMD ["agent"]
