# Make the Windows installers' payload folder: the embeddable Python with lakeshard and every
# dependency from the pinned constraints.txt (torch is the CPU build). Run on Windows (x64) with
# a full Python of the same minor version installed (the "py" launcher finds it), then build the
# installers from the folder (on Linux: installers/windows/build --payload DIR).
#
#   powershell -ExecutionPolicy Bypass -File installers\windows\make-payload.ps1 [-Out dist\payload]
#       [-PythonVersion 3.11.9] [-Wheelhouse DIR]   # -Wheelhouse: offline, from wheels only
param(
    [string]$Out = "dist\payload",
    [string]$PythonVersion = "3.11.9",
    [string]$TorchIndex = "https://download.pytorch.org/whl/cpu",
    [string]$Wheelhouse = ""
)
$ErrorActionPreference = "Stop"
$repo = (Resolve-Path "$PSScriptRoot\..\..").Path
$minor = ($PythonVersion -split "\.")[0..1] -join "."
$py = @("py", "-$minor")

if (Test-Path $Out) { Remove-Item -Recurse -Force $Out }
New-Item -ItemType Directory -Force "$Out\python" | Out-Null

# 1. the embeddable Python (python.exe, pythonw.exe, the standard library as a zip)
$zip = Join-Path $env:TEMP "python-$PythonVersion-embed-amd64.zip"
if (-not (Test-Path $zip)) {
    Invoke-WebRequest "https://www.python.org/ftp/python/$PythonVersion/python-$PythonVersion-embed-amd64.zip" -OutFile $zip
}
Expand-Archive $zip -DestinationPath "$Out\python" -Force
# it ignores site-packages until its ._pth file names the folder and imports site
$pth = Get-ChildItem "$Out\python\python3*._pth" | Select-Object -First 1
Set-Content -Encoding ascii $pth.FullName "$($pth.BaseName).zip`r`n.`r`nLib\site-packages`r`nimport site`r`n"

# 2. the lakeshard wheel, then it and its pinned dependencies into Lib\site-packages
$wheels = Join-Path $env:TEMP "lakeshard-wheel"
if (Test-Path $wheels) { Remove-Item -Recurse -Force $wheels }
& $py[0] $py[1] -m pip wheel --no-deps -w $wheels $repo
if ($LASTEXITCODE) { throw "pip wheel failed" }
$wheel = (Get-ChildItem "$wheels\lakeshard-*.whl" | Select-Object -First 1).FullName
if ($Wheelhouse) { $from = @("--no-index", "--find-links", $Wheelhouse) } else { $from = @("--extra-index-url", $TorchIndex) }
& $py[0] $py[1] -m pip install --target "$Out\python\Lib\site-packages" --only-binary=:all: --no-compile `
    -c "$repo\constraints.txt" @from "$wheel[gui]"
if ($LASTEXITCODE) { throw "pip install failed" }

# 3. check it: the bundled Python runs lakeshard, and torch is the CPU build
& "$Out\python\python.exe" -c "import importlib.metadata as m; v = m.version('torch'); assert v.endswith('+cpu'), v"
if ($LASTEXITCODE) { throw "torch in the payload is not the CPU build" }
& "$Out\python\python.exe" -m agent --version
if ($LASTEXITCODE) { throw "the payload's lakeshard does not start" }
Write-Output "payload: $Out"
