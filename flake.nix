{
  description = "primerl: asynchronous RL for language-model agents (development shells, formatter, checks)";

  # `nix develop`         Python 3.12, uv, git and the system libraries PyPI's wheels load; the shell hook syncs
  #                       .venv from uv.lock (`uv sync --locked`) and activates it.
  # `nix develop .#cuda`  the same plus the CUDA 13 toolkit (nvcc, for flash-attn's build) and the GPU extra.
  # `nix fmt`             formats the Nix files.
  # `nix flake check`     builds the locked environment from uv.lock with uv2nix (no network at build time) and runs
  #                       the fast test tier in it.
  # The Python version and the CUDA major follow uv.lock and the Dockerfiles (tests/test_consistency.py).

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";
    pyproject-nix = {
      url = "github:pyproject-nix/pyproject.nix";
      inputs.nixpkgs.follows = "nixpkgs";
    };
    uv2nix = {
      url = "github:pyproject-nix/uv2nix";
      inputs.nixpkgs.follows = "nixpkgs";
      inputs.pyproject-nix.follows = "pyproject-nix";
    };
    pyproject-build-systems = {
      url = "github:pyproject-nix/build-system-pkgs";
      inputs.nixpkgs.follows = "nixpkgs";
      inputs.pyproject-nix.follows = "pyproject-nix";
      inputs.uv2nix.follows = "uv2nix";
    };
  };

  outputs =
    {
      self,
      nixpkgs,
      pyproject-nix,
      uv2nix,
      pyproject-build-systems,
    }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: lib.genAttrs systems (system: f (pkgsFor system));
      pkgsFor =
        system:
        import nixpkgs {
          inherit system;
          config.allowUnfree = true; # the CUDA toolkit's license
        };

      pythonFor = pkgs: pkgs.python312;
      cudaFor = pkgs: pkgs.cudaPackages_13;

      # Shared libraries that manylinux wheels (torch, numpy, tokenizers, pyarrow, ...) expect from the system.
      wheelLibraries = pkgs: [
        pkgs.stdenv.cc.cc.lib
        pkgs.zlib
        pkgs.zstd
        pkgs.libffi
        pkgs.openssl
      ];

      devShell =
        pkgs:
        { cuda }:
        let
          python = pythonFor pkgs;
          cudaPackages = cudaFor pkgs;
          extras = lib.optionalString cuda "--extra gpu";
        in
        pkgs.mkShell {
          packages = [
            python
            pkgs.uv
            pkgs.git
          ]
          ++ lib.optionals cuda [ cudaPackages.cudatoolkit ];
          env = {
            UV_PYTHON = "${python}/bin/python3";
            UV_PYTHON_DOWNLOADS = "never";
            # /run/opengl-driver/lib: where NixOS puts the NVIDIA driver's libcuda.
            LD_LIBRARY_PATH = lib.makeLibraryPath (wheelLibraries pkgs) + ":/run/opengl-driver/lib";
          }
          // lib.optionalAttrs cuda {
            CUDA_HOME = "${cudaPackages.cudatoolkit}";
            TORCH_CUDA_ARCH_LIST = "9.0";
          };
          shellHook = ''
            uv sync --locked ${extras}
            . .venv/bin/activate
          '';
        };

      # The locked environment, built from uv.lock by uv2nix: every wheel fetched by the hash the lock records.
      lockedEnvironment =
        pkgs:
        let
          workspace = uv2nix.lib.workspace.loadWorkspace { workspaceRoot = ./.; };
          pythonSet =
            (pkgs.callPackage pyproject-nix.build.packages { python = pythonFor pkgs; }).overrideScope
              (
                lib.composeManyExtensions [
                  pyproject-build-systems.overlays.default
                  (workspace.mkPyprojectOverlay { sourcePreference = "wheel"; })
                ]
              );
        in
        # primerl with its default dependency groups: dev (pytest) and envs (the workspace's environment packages).
        pythonSet.mkVirtualEnv "primerl-env" (workspace.deps.default // { primerl = [ "dev" "envs" ]; });
    in
    {
      devShells = forAllSystems (pkgs: {
        default = devShell pkgs { cuda = false; };
        cuda = devShell pkgs { cuda = true; };
      });

      formatter = forAllSystems (pkgs: pkgs.nixfmt-rfc-style);

      checks = forAllSystems (pkgs: {
        fast-tests =
          pkgs.runCommand "primerl-fast-tests"
            {
              nativeBuildInputs = [ (lockedEnvironment pkgs) ];
              LD_LIBRARY_PATH = lib.makeLibraryPath (wheelLibraries pkgs);
            }
            ''
              cp -r ${./.} source && chmod -R u+w source && cd source
              export HOME=$TMPDIR PRIMERL_CACHE=$TMPDIR/primerl-cache
              python -m pytest -q -m "not integration and not system and not slow" -p no:cacheprovider
              touch $out
            '';
      });
    };
}
