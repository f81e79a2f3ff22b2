; lakeshard's Windows installer, per user (no administrator needed):
;   makensis -DVERSION=0.1.0 -DPAYLOAD=C:\path\to\payload [-DOUTFILE=out.exe] lakeshard.nsi
; installers/windows/build does this (and the MSI). PAYLOAD is the folder make-payload.ps1 makes:
; python\ (the embeddable Python with lakeshard and its wheels in Lib\site-packages).
; Installs to %LOCALAPPDATA%\Programs\lakeshard; the tray starts at login (HKCU Run, the value
; the tray's own "Start at login" setting writes); a firewall rule only where the installer runs
; elevated (otherwise an administrator runs firewall.cmd add later).
Unicode true
!include "MUI2.nsh"
!include "LogicLib.nsh"

!ifndef VERSION
  !error "give the version: -DVERSION=x.y.z"
!endif
!ifndef PAYLOAD
  !error "give the payload folder: -DPAYLOAD=folder (see make-payload.ps1)"
!endif
!ifndef OUTFILE
  !define OUTFILE "lakeshard-${VERSION}-setup.exe"
!endif
!define ICON "..\..\assets\icons\lakeshard.ico"
!define APPKEY "Software\lakeshard"
!define UNINSTKEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\lakeshard"
!define RUNKEY "Software\Microsoft\Windows\CurrentVersion\Run"
!define TRAY '"$INSTDIR\python\pythonw.exe" -m agent tray'

Name "lakeshard ${VERSION}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\Programs\lakeshard"
InstallDirRegKey HKCU "${APPKEY}" "InstallDir"
RequestExecutionLevel user
SetCompressor /SOLID lzma
BrandingText "lakeshard ${VERSION}"
VIProductVersion "${VERSION}.0"
VIAddVersionKey "ProductName" "lakeshard"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "lakeshard installer"
VIAddVersionKey "LegalCopyright" "Apache-2.0"

!define MUI_ICON "${ICON}"
!define MUI_UNICON "${ICON}"
!define MUI_COMPONENTSPAGE_SMALLDESC
!define MUI_FINISHPAGE_RUN "$INSTDIR\python\pythonw.exe"
!define MUI_FINISHPAGE_RUN_PARAMETERS "-m agent tray"
!define MUI_FINISHPAGE_RUN_TEXT "Start lakeshard now"
!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

Section "lakeshard (required)" SecApp
  SectionIn RO
  SetOutPath "$INSTDIR"
  File /r "${PAYLOAD}\*"
  File "lakeshard.cmd"
  File "firewall.cmd"
  File "/oname=lakeshard.ico" "${ICON}"
  WriteUninstaller "$INSTDIR\uninstall.exe"
  WriteRegStr HKCU "${APPKEY}" "InstallDir" "$INSTDIR"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayName" "lakeshard"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINSTKEY}" "Publisher" "lakeshard"
  WriteRegStr HKCU "${UNINSTKEY}" "DisplayIcon" "$INSTDIR\lakeshard.ico"
  WriteRegStr HKCU "${UNINSTKEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINSTKEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINSTKEY}" "QuietUninstallString" '"$INSTDIR\uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINSTKEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINSTKEY}" "NoRepair" 1
  CreateDirectory "$SMPROGRAMS\lakeshard"
  CreateShortcut "$SMPROGRAMS\lakeshard\lakeshard.lnk" "$INSTDIR\python\pythonw.exe" "-m agent tray" \
    "$INSTDIR\lakeshard.ico" 0 SW_SHOWNORMAL "" "Share this laptop's idle capacity with the office's LLM cluster"
  CreateShortcut "$SMPROGRAMS\lakeshard\lakeshard doctor.lnk" "$SYSDIR\cmd.exe" '/k "$INSTDIR\lakeshard.cmd" doctor' \
    "$INSTDIR\lakeshard.ico" 0 SW_SHOWNORMAL "" "Check what this laptop offers the cluster"
  CreateShortcut "$SMPROGRAMS\lakeshard\Uninstall lakeshard.lnk" "$INSTDIR\uninstall.exe"
SectionEnd

Section "Start lakeshard at login" SecAutostart
  WriteRegStr HKCU "${RUNKEY}" "lakeshard" '${TRAY}'
SectionEnd

Section "Windows Firewall rule (needs administrator)" SecFirewall
  UserInfo::GetAccountType
  Pop $0
  ${If} $0 == "Admin"
    nsExec::ExecToLog '"$INSTDIR\firewall.cmd" add'
    Pop $0
    DetailPrint "firewall rule lakeshard: exit status $0"
  ${Else}
    DetailPrint "Not elevated: no firewall rule. An administrator can run: $INSTDIR\firewall.cmd add"
  ${EndIf}
SectionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecApp} "The tray app, the agent and their Python runtime."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecAutostart} "Start the tray when you log in (HKCU Run)."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecFirewall} "Let other lakeshard laptops reach this one (TCP/UDP 7700, mDNS 5353). Only when the installer runs as administrator."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

Section "Uninstall"
  DeleteRegValue HKCU "${RUNKEY}" "lakeshard"
  UserInfo::GetAccountType
  Pop $0
  ${If} $0 == "Admin"
    nsExec::ExecToLog '"$INSTDIR\firewall.cmd" remove'
    Pop $0
  ${Else}
    DetailPrint "Not elevated: an administrator removes the firewall rule with: netsh advfirewall firewall delete rule name=lakeshard"
  ${EndIf}
  Delete "$SMPROGRAMS\lakeshard\lakeshard.lnk"
  Delete "$SMPROGRAMS\lakeshard\lakeshard doctor.lnk"
  Delete "$SMPROGRAMS\lakeshard\Uninstall lakeshard.lnk"
  RMDir "$SMPROGRAMS\lakeshard"
  ; the program only: settings, credentials, models and logs (%LOCALAPPDATA%\lakeshard) stay
  RMDir /r "$INSTDIR\python"
  Delete "$INSTDIR\lakeshard.cmd"
  Delete "$INSTDIR\firewall.cmd"
  Delete "$INSTDIR\lakeshard.ico"
  Delete "$INSTDIR\uninstall.exe"
  RMDir "$INSTDIR"
  DeleteRegKey HKCU "${UNINSTKEY}"
  DeleteRegKey HKCU "${APPKEY}"
SectionEnd
