@echo off
rem lakeshard's Windows Firewall rules, all named "lakeshard". Run as administrator:
rem   firewall.cmd add      allow the agent in (private and domain networks)
rem   firewall.cmd remove   delete every rule named lakeshard
rem The program rules cover the elected coordinator's ring port (a free port it picks); the
rem port rules name the agent's data port (7700 TCP data plane, UDP peer beats), the elected
rem coordinator's ring port (7702 TCP) and mDNS (5353).
setlocal
set "HERE=%~dp0"
netsh advfirewall firewall delete rule name="lakeshard" >nul 2>&1
if /i "%~1"=="remove" exit /b 0
netsh advfirewall firewall add rule name="lakeshard" dir=in action=allow enable=yes profile=domain,private program="%HERE%python\python.exe" || exit /b 1
netsh advfirewall firewall add rule name="lakeshard" dir=in action=allow enable=yes profile=domain,private program="%HERE%python\pythonw.exe" || exit /b 1
netsh advfirewall firewall add rule name="lakeshard" dir=in action=allow enable=yes profile=domain,private protocol=TCP localport=7700,7702 || exit /b 1
netsh advfirewall firewall add rule name="lakeshard" dir=in action=allow enable=yes profile=domain,private protocol=UDP localport=7700,5353 || exit /b 1
exit /b 0
