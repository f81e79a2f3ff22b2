@echo off
rem The lakeshard command (lakeshard doctor, lakeshard status, ...) with the bundled Python.
"%~dp0python\python.exe" -m agent %*
