{
  description = "fused-kernels: fused Triton kernels for LLM training, as a Hugging Face kernel repository";

  # Why not kernel-builder's `kernel-builder.lib.genKernelFlakeOutputs { inherit self; path = ./.; }`:
  # for a noarch (Triton) kernel it emits only the noarch torch-<backend> variants, never the per-torch,
  # per-CUDA arch variants of build-matrix.toml, and it ships only torch-ext/<module>/, so kernels_src/
  # would not end up in each CUDA variant's _kernels/. The project therefore runs its own builder
  # (tools/fused_kernels_tools, the same one `make build` and CI run), so every path gives the same bytes.
  #
  # Commit a flake.lock (`nix flake lock`) on a machine with network access before relying on this flake.

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      # The builder only copies and hashes files: one build host emits the variants of every platform
      # (x86_64 and aarch64). The host is x86_64-linux because that is the kernels wheel pinned below.
      system = "x86_64-linux";
      pkgs = nixpkgs.legacyPackages.${system};
      lib = pkgs.lib;
      python = pkgs.python3;
      buildToml = builtins.fromTOML (builtins.readFile ./build.toml);

      # kernels is not packaged in nixpkgs. 0.17.2 contains a Rust extension (kernels._rust), and its sdist
      # needs maturin plus vendored crates, so this uses the manylinux wheel from PyPI (the same file pip
      # installs for requirements-dev.txt).
      kernels = python.pkgs.buildPythonPackage rec {
        pname = "kernels";
        version = "0.17.2";
        format = "wheel";
        src = python.pkgs.fetchPypi {
          inherit pname version format;
          dist = "cp38";
          python = "cp38";
          abi = "abi3";
          platform = "manylinux_2_17_x86_64.manylinux2014_x86_64";
          hash = "sha256-9L4zNwcOaXm7QZ5RPZpR3fv+YacHr9aqfzy2phdkpGo=";
        };
        nativeBuildInputs = [ pkgs.autoPatchelfHook ];
        buildInputs = [ pkgs.stdenv.cc.cc.lib ];
        dependencies = with python.pkgs; [ huggingface-hub packaging pyyaml sigstore tomlkit ];
        # nixpkgs' versions of these may differ from requirements-dev.txt; the builder and `check` use
        # kernels' metadata, digest, variant and layer-validation code, not its Hub client.
        dontCheckRuntimeDeps = true;
        pythonImportsCheck = [ "kernels" ];
      };

      # The builder needs kernels only; torch (nixpkgs' default build is CPU-only) comes along so the
      # variants can be imported from this environment.
      buildPython = python.withPackages (ps: [ kernels ps.torch ]);
      # `check` also imports transformers (layer validation) and triton (the CUDA variants' _kernels/).
      devPython = python.withPackages (ps: [
        kernels ps.torch ps.triton ps.transformers ps.hypothesis ps.pytest ps.numpy
      ]);

      # A flake source has no .git: pass the revision explicitly (dirty trees only have dirtyRev).
      commit = self.rev or (lib.removeSuffix "-dirty" (self.dirtyRev or (lib.fixedWidthString 40 "0" "")));
      dirtyFlag = lib.optionalString (!(self ? rev)) "--dirty";

      variants = pkgs.stdenvNoCC.mkDerivation {
        pname = "fused-kernels-variants";
        version = toString buildToml.general.version;
        src = self;
        nativeBuildInputs = [ buildPython ];
        dontConfigure = true;
        dontInstall = true;
        dontFixup = true;
        buildPhase = ''
          runHook preBuild
          export HOME=$TMPDIR PYTHONDONTWRITEBYTECODE=1
          PYTHONPATH=tools python -m fused_kernels_tools build --source . --out $out \
            --commit ${commit} ${dirtyFlag}
          runHook postBuild
        '';
      };
    in
    {
      # `nix build` leaves the variant directories in result/ (result/torch-cuda, result/torch-cpu, ...).
      packages.${system} = {
        default = variants;
        inherit variants;
      };

      checks.${system}.default = pkgs.runCommand "fused-kernels-check" { nativeBuildInputs = [ devPython ]; } ''
        export HOME=$TMPDIR PYTHONDONTWRITEBYTECODE=1
        cd ${self}
        PYTHONPATH=tools python -m fused_kernels_tools check ${variants}
        touch $out
      '';

      devShells.${system}.default = pkgs.mkShell {
        packages = [ devPython pkgs.check-jsonschema pkgs.git pkgs.gnumake ];
        shellHook = ''
          export PYTHONPATH="$PWD/tools''${PYTHONPATH:+:$PYTHONPATH}"
        '';
      };
    };
}
